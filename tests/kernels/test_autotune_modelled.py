"""The compile-checked (modelled) tuning cache: its merge rule and who reads it.

Nothing compiles here: ``evaluate`` is a stand-in for bench.tpu.compiled.evaluate_modelled, so these run
everywhere in a second. The real search is ``python -m bench.tune --target tpu-v6e`` (libtpu).
"""

import json

from bench.kernels import autotune_search as search
from kernels import autotune, backend
from kernels.grpo_loss import OP, LossBlocks

SHAPE = dict(dtype="bfloat16", tokens=8192, vocab=151936)
KIND = "TPU v6 lite"


def _problem():
  return search.Problem(OP, SHAPE, lambda: (), lambda: None, ())


def _entry(time_s, block_n):
  blocks = autotune.blocks_to_json(LossBlocks(block_n, 4096))
  row = dict(impl="pallas", blocks=blocks, label="x", ok=True, time_s=time_s, parity_error=None)
  return dict(shape=SHAPE, winner=dict(impl="pallas", blocks=blocks), candidates=[row])


def _tune(tmp_path, source, block_n):
  evaluate = lambda problem, cands, deadline, log: _entry(1e-3, block_n)
  return search.tune(
    [_problem()], lambda p: [], kind=KIND, directory=tmp_path, evaluate=evaluate, source=source,
    log=lambda line: None,
  )  # fmt: skip


def test_measured_entry_always_wins(tmp_path):
  """Catches: a modelled tune (compiled on a CPU host) overwriting what a TPU measured."""
  path = _tune(tmp_path, "modelled", 16)
  data = json.loads(path.read_text())
  (entry,) = data["entries"]["grpo_loss"].values()
  assert entry["source"] == "modelled" and data["sources"] == ["modelled"]
  assert path.name == "tpu-v6-lite.json"  # keyed by the generation's device kind
  _tune(tmp_path, "measured", 32)  # a measured tune replaces a modelled entry
  _tune(tmp_path, "modelled", 64)  # ... and a later modelled one does not replace it
  (entry,) = json.loads(path.read_text())["entries"]["grpo_loss"].values()
  assert entry["source"] == "measured" and entry["winner"]["blocks"]["block_n"] == 32


def test_deviceless_tpu_target_reads_its_generations_cache(tmp_path):
  """Catches: impl="auto" ignoring a generation's (modelled) cache when compiling for it without a
  TPU, or reading another device kind's; an unnamed TPU target or the interpreter reading any."""
  _tune(tmp_path, "modelled", 16)
  with autotune.use_cache_dir(tmp_path):
    if backend.host_platform() != "tpu":
      target = backend.Target("tpu", interpret=False, generation="v6e")
      impl, blocks = autotune.resolve(OP, "auto", None, target, SHAPE)
      assert (impl, blocks) == ("pallas", LossBlocks(16, 4096))
      other = backend.Target("tpu", interpret=False, generation="v5e")
      assert autotune.resolve(OP, "auto", None, other, SHAPE) == ("auto", None)
      unnamed = backend.Target("tpu", interpret=False)
      assert autotune.resolve(OP, "auto", None, unnamed, SHAPE) == ("auto", None)
    interp = backend.Target("tpu", interpret=True, generation="v6e")
    assert autotune.resolve(OP, "auto", None, interp, SHAPE) == ("auto", None)
