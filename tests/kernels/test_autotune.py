"""The autotuner's plumbing on CPU at tiny sizes: parity gating, the versioned cache file, lookup and
fallback, and how a cache entry fills ``impl="auto"`` / default blocks. (Timings here are meaningless:
CPU interpreters; nothing asserts which real impl is faster.)"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from bench import tune as bench_tune
from bench.kernels import autotune_search as search
from bench.kernels.cases import Check
from kernels import autotune, backend, optim
from kernels.fused_linear import ChunkBlocks
from kernels.fused_linear import mosaic_gpu_blocks as linear_mosaic
from kernels.grpo_loss import OP
from kernels.grpo_loss.mosaic_gpu_blocks import MosaicLossBlocks

SHAPE = dict(dtype="float32", tokens=64, vocab=512)


def _problem():
  def inputs():
    x = jax.random.normal(jax.random.key(0), (64, 512), jnp.float32)
    return (x,)

  reference = lambda x: (jax.nn.logsumexp(x, axis=1),)
  check = (Check(0, "value", "float32", 512, "lse"),)
  return search.Problem(OP, SHAPE, inputs, reference, check), reference


def test_parity_failing_candidate_never_wins_even_when_fastest(tmp_path):
  """A candidate returning zeros is the fastest thing there is; it must be recorded as failing and
  lose to the slower correct candidates. A candidate that raises is recorded, not fatal."""
  problem, reference = _problem()
  slow_ok = lambda x: (jax.nn.logsumexp(jnp.sort(x, axis=1), axis=1),)  # same values, more work

  def raises(x):
    raise ValueError("illegal blocks")

  cands = [
    search.Candidate("xla", None, reference),
    search.Candidate("pallas", MosaicLossBlocks(64, 64, 2), slow_ok),
    search.Candidate("mosaic_gpu", MosaicLossBlocks(64, 128, 2), lambda x: (jnp.zeros(64),)),
    search.Candidate("mosaic_gpu", MosaicLossBlocks(64, 256, 2), raises),
  ]
  path = search.tune([problem], lambda p: cands, kind="Test GPU 1", directory=tmp_path, repeats=2)
  data = json.loads(path.read_text())
  entry = data["entries"]["grpo_loss"][OP.bucket(SHAPE)]
  rows = entry["candidates"]
  assert [r["ok"] for r in rows] == [True, True, False, False]
  assert rows[2]["time_s"] is None and rows[2]["parity_error"] > 1
  assert "illegal blocks" in rows[3]["error"]
  assert entry["winner"]["impl"] in ("xla", "pallas")
  assert all(r["time_s"] > 0 for r in rows[:2])


def test_cache_file_is_versioned_per_device_kind(tmp_path):
  problem, reference = _problem()
  cands = [search.Candidate("xla", None, reference)]
  path = search.tune([problem], lambda p: cands, kind="NVIDIA H100 80GB HBM3", directory=tmp_path)
  assert path.name == "nvidia-h100-80gb-hbm3.json"
  data = json.loads(path.read_text())
  assert data["schema"] == autotune.SCHEMA
  assert data["device_kind"] == "NVIDIA H100 80GB HBM3"
  assert data["jax_version"] == jax.__version__
  assert data["date"] and "commit" in data
  # a second run merges into the same file, keeping the other buckets
  other = search.Problem(OP, dict(SHAPE, vocab=256), *_problem_parts(256))
  search.tune([other], lambda p: cands, kind="NVIDIA H100 80GB HBM3", directory=tmp_path)
  entries = json.loads(path.read_text())["entries"]["grpo_loss"]
  assert len(entries) == 2
  with autotune.use_cache_dir(tmp_path):
    assert autotune.lookup(OP, SHAPE, kind="NVIDIA H100 80GB HBM3")["winner"]["impl"] == ("xla")
    assert autotune.lookup(OP, SHAPE, kind="NVIDIA H200") is None  # other device: absent
    assert autotune.lookup(OP, dict(SHAPE, vocab=999), kind="NVIDIA H100 80GB HBM3") is None


def _problem_parts(v):
  inputs = lambda: (jax.random.normal(jax.random.key(1), (8, v), jnp.float32),)
  reference = lambda x: (jax.nn.logsumexp(x, axis=1),)
  return inputs, reference, (Check(0, "value", "float32", v, "lse"),)


def test_other_schema_is_ignored(tmp_path):
  path = autotune.cache_path("Old GPU", tmp_path)
  path.write_text(json.dumps(dict(schema=0, entries={"grpo_loss": {}})))
  with autotune.use_cache_dir(tmp_path):
    assert autotune.lookup(OP, SHAPE, kind="Old GPU") is None


def test_buckets_round_counts_but_keep_vocab_exact():
  b = lambda **kw: OP.bucket(dict(SHAPE, **kw))
  assert b(tokens=5000) == b(tokens=8192) != b(tokens=8193)
  assert b(vocab=151936) != b(vocab=151935)
  with pytest.raises(ValueError, match="ops must be among"):  # the tuner knows each op's table
    bench_tune.run("tiny", ops=("matmul",))


ENTRY = dict(
  winner=dict(impl="mosaic_gpu", blocks=dict(block_n=64, block_v=128, stages=3)),
  candidates=[
    dict(impl="xla", blocks=None, ok=True, time_s=3.0),
    dict(
      impl="pallas",
      blocks=dict(block_n=1, block_v=4096, num_warps=8, num_stages=1),
      ok=True,
      time_s=2.0,
    ),
    dict(
      impl="pallas",
      blocks=dict(block_n=1, block_v=8192, num_warps=4, num_stages=1),
      ok=False,
      time_s=None,
    ),
    dict(
      impl="pallas",
      blocks=dict(block_n=1, block_v=2048, num_warps=4, num_stages=1),
      ok=True,
      time_s=2.5,
    ),
    dict(impl="mosaic_gpu", blocks=dict(block_n=64, block_v=128, stages=3), ok=True, time_s=1.0),
  ],
)


def test_apply_entry_fills_auto_and_default_blocks():
  impl, blocks = autotune.apply_entry(OP, "auto", None, ENTRY)
  assert impl == "mosaic_gpu" and blocks == MosaicLossBlocks(64, 128, 3)
  impl, blocks = autotune.apply_entry(OP, "pallas", None, ENTRY)
  assert impl == "pallas" and blocks == kernels.LossBlocks(1, 4096, 8, 1)  # fastest *passing*
  given = kernels.LossBlocks(1, 1024)
  assert autotune.apply_entry(OP, "pallas", given, ENTRY) == ("pallas", given)
  assert autotune.apply_entry(OP, "auto", given, ENTRY) == ("auto", given)
  assert autotune.apply_entry(OP, "xla", None, ENTRY) == ("xla", None)
  assert autotune.apply_entry(OP, "auto", None, None) == ("auto", None)  # fallback


def test_interpreted_targets_never_read_the_cache(tmp_path):
  """A cache for this very host says mosaic_gpu; the CPU target (always interpreted) keeps the
  heuristic, so impl="auto" on CPU stays the XLA reference."""
  kind = autotune.device_kind()
  bucket = OP.bucket(SHAPE)
  data = dict(schema=autotune.SCHEMA, entries={"grpo_loss": {bucket: ENTRY}})
  autotune.cache_path(kind, tmp_path).write_text(json.dumps(data))
  with autotune.use_cache_dir(tmp_path):
    assert autotune.lookup(OP, SHAPE)["winner"]["impl"] == "mosaic_gpu"
    target = backend.make_target("cpu")
    assert autotune.resolve(OP, "auto", None, target, SHAPE) == ("auto", None)
    gpu_from_cpu = backend.make_target("gpu", interpret=False)  # not this host's platform
    assert autotune.resolve(OP, "auto", None, gpu_from_cpu, SHAPE) == ("auto", None)
    logits = jnp.zeros((1, 64, 512))
    ids, mask, adv = jnp.zeros((1, 64), jnp.int32), jnp.ones((1, 64), bool), jnp.ones(1)
    auto = kernels.grpo_loss(logits, ids, mask, adv, impl="auto")[0]
    np.testing.assert_allclose(auto, kernels.grpo_loss(logits, ids, mask, adv, impl="xla")[0])


def test_bench_tune_tiny_end_to_end(tmp_path):
  """``python -m bench.tune --size tiny``: the bench's own problems, every candidate kind this host
  can run (xla, the interpreted pallas and mosaic_gpu kernels), all passing parity, one winner each."""
  path = bench_tune.run("tiny", tmp_path, ops=("grpo_loss",), repeats=1, log=lambda s: None)
  entry = next(iter(json.loads(path.read_text())["entries"]["grpo_loss"].values()))
  impls = {r["impl"] for r in entry["candidates"]}
  assert impls == {"xla", "pallas", "mosaic_gpu"}
  assert all(r["ok"] for r in entry["candidates"]), entry["candidates"]
  assert entry["winner"]["impl"] in impls


# ------------------------------------------------------------------------- a tune that finishes
def test_heuristic_first_budget_and_a_line_per_candidate(tmp_path):
  """Catches a tune that prints nothing for minutes and never stops (the H100 run's tune step): the
  heuristic is timed first and reported as the baseline (never the winner), every candidate gets a
  line as it finishes, and a spent budget leaves later candidates recorded as not tried."""
  problem, reference = _problem()
  problem = dataclasses.replace(problem, heuristic=reference)
  lines = []
  cands = [search.Candidate("xla", None, reference)] * 3
  search.tune([problem], lambda p: cands, kind="T", directory=tmp_path, repeats=1, log=lines.append)
  timed = [line for line in lines if line.startswith("  ")]
  assert len(timed) == 4 and " heuristic: " in timed[0] and all(" ms, parity " in t for t in timed)
  path = search.tune(
    [problem],
    lambda p: cands,
    kind="T",
    directory=tmp_path,
    repeats=1,
    budget_s=1e-9,
    log=lines.append,
  )
  entry = json.loads(path.read_text())["entries"]["grpo_loss"][OP.bucket(SHAPE)]
  assert entry["heuristic"]["ok"] and entry["heuristic"]["time_s"] > 0  # the baseline always runs
  assert [r.get("skipped") for r in entry["candidates"]] == ["the op's time budget was spent"] * 3
  assert entry["winner"] is None


def test_a_killed_tune_keeps_the_problems_it_finished(tmp_path):
  """Catches a cache written only at the end: the second problem's candidates raise
  KeyboardInterrupt (a kill); the first problem's entry must already be on disk."""
  first, reference = _problem()
  second = search.Problem(OP, dict(SHAPE, vocab=256), *_problem_parts(256))

  def killed(x):
    raise KeyboardInterrupt

  cands = {SHAPE["vocab"]: [search.Candidate("xla", None, reference)]}
  cands[256] = [search.Candidate("xla", None, killed)]
  with pytest.raises(KeyboardInterrupt):
    search.tune(
      [first, second], lambda p: cands[p.shape["vocab"]], kind="T", directory=tmp_path, repeats=1
    )
  entries = json.loads(autotune.cache_path("T", tmp_path).read_text())["entries"]["grpo_loss"]
  assert list(entries) == [OP.bucket(SHAPE)]
  assert entries[OP.bucket(SHAPE)]["winner"]["impl"] == "xla"


def test_every_op_has_problems_candidates_and_blocks_that_round_trip():
  """Catches an op the tuner silently skips (optim and fused_linear were missing): each op yields
  tiny problems with a heuristic and candidates whose blocks survive the JSON cache."""
  assert {name: table.name for name, (table, _, _) in bench_tune.OPS.items()} == {
    op: op for op in ("grpo_loss", "paged_attention", "optim", "fused_linear")
  }
  for op, (table, problems_of, _) in bench_tune.OPS.items():
    problems = problems_of("tiny", "cpu")
    assert problems and all(p.heuristic is not None and p.op is table for p in problems), op
    for p in problems:
      table.bucket(p.shape)
      cands = bench_tune.candidates(p, "cpu") + bench_tune.candidates(p, "gpu")  # GPU grids too
      for c in cands:
        data = autotune.blocks_to_json(c.blocks)
        assert table.blocks_from_json(c.impl, data) == c.blocks
  with pytest.raises(ValueError, match="chunk_size must be a positive int"):
    ChunkBlocks(0)
  # on GPU the optimizer's candidates are the multi-tensor launch's grid (one launch per tree), not
  # the per-leaf tiles: a stale grid would time blocks the GPU path never runs
  gpu = bench_tune.candidates(bench_tune.optim_problems("tiny", "cpu")[0], "gpu")
  pallas = [c.blocks for c in gpu if c.impl == "pallas"]
  assert pallas == optim.candidate_blocks(4, 3) and isinstance(pallas[0], optim.MultiTensorBlocks)
  # the fused LM-head loss's Mosaic GPU grid is offered for bf16 on GPU
  shape = dict(dtype="bfloat16", tokens=8192, hidden=2048, vocab=151936)
  problem = dataclasses.replace(bench_tune.linear_problems("tiny", "cpu")[0], shape=shape)
  mosaic = [c for c in bench_tune.candidates(problem, "gpu") if c.impl == "mosaic_gpu"]
  assert mosaic and mosaic[0].blocks == linear_mosaic.candidate_blocks(shape, "gpu")[0]


def test_bench_tune_tiny_new_ops_end_to_end(tmp_path):
  """optim and fused_linear through the real tuner at tiny shapes: every candidate passes parity."""
  path = bench_tune.run("tiny", tmp_path, ops=("fused_linear",), repeats=1, log=lambda s: None)
  entry = next(iter(json.loads(path.read_text())["entries"]["fused_linear"].values()))
  assert {r["impl"] for r in entry["candidates"]} == {"xla", "chunked", "pallas"}
  assert all(r["ok"] for r in entry["candidates"]) and entry["heuristic"]["ok"]
