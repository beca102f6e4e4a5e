"""The op protocol (kernels.ops): each op's one table is honest about its backend files, and a new
backend is one row in it (docs/ops.md's worked example, run here on a test-local table).

The toy backend is a second pure-JAX implementation of grpo_loss (log-softmax over row chunks, then the
shared objective): no kernel, but everything the table drives (choices, ``auto``, the tuned cache,
legality, the tuner's candidates, rl's per-platform choices, the call) reaches it through the row."""

import dataclasses
import importlib
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

from bench.tolerances import assert_close
from kernels import autotune, backend, loss_spec, ops
from kernels.grpo_loss import impls as loss_impls
from kernels.grpo_loss.args import validate_loss_args
from kernels.grpo_loss.reference import objective_and_loss, token_logps_and_entropy
from tests.kernels.grpo_loss.test_grpo_loss import make_problem

PACKAGES = ("grpo_loss", "fused_linear", "paged_attention", "optim")
# the naming scheme (docs/ops.md): a backend's file, its parts <backend>_<part>.py (blocks, helpers)
BACKENDS = ("reference", "pallas", "pallas_tpu", "pallas_triton", "mosaic_gpu", "chunked")


def _table(package: str) -> ops.Op:
  return importlib.import_module(f"kernels.{package}.impls").OP


@pytest.mark.parametrize("package", PACKAGES)
def test_every_backend_file_belongs_to_an_impl_of_its_op(package):
  """Catches: a backend file no impl of the op names (dead, or reached around the table), an impl
  naming a module outside its op's folder, or a file whose backend prefix names nothing there
  (``tiles.py`` / ``multi.py``: names that say what the file holds, not which backend it is)."""
  op = _table(package)
  folder = pathlib.Path(importlib.import_module(f"kernels.{package}").__file__).parent
  claimed = {m.__name__ for impl in op.implementations.values() for m in impl.modules}
  assert all(m.startswith(f"kernels.{package}.") for m in claimed), claimed
  stems = {m.rpartition(".")[2] for m in claimed}
  for path in folder.glob("*.py"):
    if path.stem in BACKENDS:
      assert path.stem in stems, f"{path.name} is in no impl of {op.name}'s table"
    prefix = max((b for b in BACKENDS if path.stem.startswith(b + "_")), key=len, default=None)
    if prefix is not None:
      assert prefix in stems | set(op.implementations), f"{path.name}: no backend {prefix!r} here"


@pytest.mark.parametrize("package", PACKAGES)
def test_tables_are_complete(package):
  """Every impl runs somewhere, has a call and, where it takes blocks, a heuristic and candidates
  whose blocks are its own classes (the tuner's JSON reads them back); ``auto`` names real impls."""
  op = _table(package)
  for name, impl in op.implementations.items():
    assert impl.platforms and impl.run is not None, name
    for platform in impl.platforms:
      assert set(op.auto) == {"cpu", "gpu", "tpu"}
      for blocks in impl.candidates(_shape(package), platform):
        assert blocks is None or isinstance(blocks, impl.blocks), (name, blocks)
        assert op.blocks_from_json(name, autotune.blocks_to_json(blocks)) == blocks


def _shape(package: str) -> dict:
  return {
    "grpo_loss": dict(dtype="bfloat16", tokens=8192, vocab=151936),
    "fused_linear": dict(dtype="bfloat16", tokens=8192, hidden=2048, vocab=151936),
    "paged_attention": dict(
      dtype="bfloat16", batch=64, q_heads=16, kv_heads=2, head_dim=128, page_size=16, ctx=4096
    ),
    "optim": dict(rule="adamw", dtype="float32", params=1 << 20),
  }[package]


# ------------------------------------------------------------------- a new backend is one row
@dataclasses.dataclass(frozen=True)
class RowChunks:
  """The toy backend's one tile: token rows per chunk of its log-softmax."""

  rows: int

  def __post_init__(self):
    if not isinstance(self.rows, int) or self.rows <= 0:
      raise ValueError(f"RowChunks.rows must be a positive int, got {self.rows!r}")


def _row_chunks_run(call: loss_impls.Call):
  """grpo_loss by log-softmax over ``rows``-row chunks (lax.map), then the shared objective."""
  a, spec = call.args, call.spec
  b, t, v = a.logits.shape
  rows = (call.blocks or RowChunks(64)).rows
  one = lambda xi: token_logps_and_entropy(xi[0], xi[1], spec.temperature)
  flat = (a.logits.reshape(b * t, v), a.ids.reshape(b * t))
  logp, entropy = jax.lax.map(one, flat, batch_size=rows)
  logps = dict(old_logps=a.old_logps, ref_logps=a.ref_logps, sampler_logps=a.sampler_logps)
  loss, aux = objective_and_loss(
    logp.reshape(b, t), entropy.reshape(b, t), a.mask, a.advantages, spec,
    num_items_in_batch=call.num_items_in_batch, **logps,
  )  # fmt: skip
  return (loss if call.scale is None else loss * call.scale), aux


ROW_CHUNKS = ops.Impl(
  modules=(loss_impls.reference,),  # a real row would name its own file, e.g. grpo_loss/xla_rows.py
  blocks=(RowChunks,),
  platforms=("cpu", "tpu"),
  heuristic=lambda target, shape: RowChunks(64),
  candidates=lambda shape, platform: [RowChunks(r) for r in (32, 128)],
  supported_on=lambda target, shape, b: (
    None if (b or RowChunks(64)).rows <= 4096 else "rows > 4096"
  ),
  run=_row_chunks_run,
)
# the test-local table: grpo_loss's, plus the row (in impls.py this is one more dict entry)
TABLE = dataclasses.replace(
  loss_impls.OP, implementations={**loss_impls.IMPLEMENTATIONS, "row_chunks": ROW_CHUNKS}
)


def test_a_new_backend_is_one_row_in_its_ops_table():
  """Catches: a place that lists implementations by hand instead of reading the table (the impl
  check, the tuner's candidates and JSON, rl's per-platform choices), and shows the toy row's
  values against the reference through the same steps the public function takes."""
  TABLE.check("row_chunks")
  with pytest.raises(ValueError, match="impl must be one of"):
    loss_impls.OP.check("row_chunks")  # the real table is untouched
  assert TABLE.on("tpu") == ("pallas", "xla", "row_chunks") and "row_chunks" not in TABLE.on("gpu")
  shape = dict(dtype="float32", tokens=96, vocab=40)
  cands = TABLE.candidates(shape, "cpu")
  assert [c for c in cands if c[0] == "row_chunks"] == [
    ("row_chunks", RowChunks(r)) for r in (32, 128)
  ]
  assert TABLE.blocks_from_json("row_chunks", {"rows": 32}) == RowChunks(32)
  tpu = backend.Target("tpu", interpret=False, generation="v6e")
  TABLE.check_tuned(tpu, shape)("row_chunks", RowChunks(32))
  with pytest.raises(ValueError, match="rows > 4096"):
    TABLE.check_tuned(tpu, shape)("row_chunks", RowChunks(8192))
  # the public function's steps: check, resolve (no cache on the interpreter), legality, run
  args, kw = make_problem(2, 48, 40, jnp.float32, off_policy=True, beta=0.04)
  loss, aux = _call("row_chunks", args, kw, RowChunks(16))
  ref_loss, ref_aux = _call("xla", args, kw, None)
  assert_close(loss, ref_loss, "value", jnp.float32, 40, "row_chunks loss")
  assert_close(aux.per_token_logps, ref_aux.per_token_logps, "value", jnp.float32, 40, "logps")


def _call(impl: str, args, kw: dict, blocks):
  """What ``kernels.grpo_loss`` does with its arguments, on the test-local table."""
  arrays = {k: kw.get(k) for k in ("old_logps", "ref_logps", "sampler_logps")}
  spec = loss_spec.resolve(None, **{k: v for k, v in kw.items() if k not in arrays})
  checked = validate_loss_args(*args, **arrays, spec=spec, num_items_in_batch=None)
  b, t, v = checked.logits.shape
  target = backend.resolve("cpu")
  shape = dict(dtype="float32", tokens=b * t, vocab=v)
  impl, blocks = TABLE.resolve(impl, blocks, target, shape)
  assert TABLE[impl].supported_on(target, shape, blocks) is None
  call = loss_impls.Call(checked, spec, None, target, blocks, False, None, None, b * t)
  return TABLE[impl].run(call)


def test_a_tuned_entry_for_the_new_row_is_read_back(tmp_path):
  """The tuner's cache names impls by their table's strings: an entry whose winner is the new row
  comes back as its blocks for ``auto`` on the device kind it was tuned for."""
  tpu = backend.Target("tpu", interpret=False, generation="v6e")
  shape = dict(dtype="bfloat16", tokens=8192, vocab=151936)
  entry = dict(winner=dict(impl="row_chunks", blocks={"rows": 128}), candidates=[])
  data = dict(schema=autotune.SCHEMA, entries={"grpo_loss": {TABLE.bucket(shape): entry}})
  autotune.cache_path(tpu.tpu.device_kind, tmp_path).write_text(json.dumps(data))
  with autotune.use_cache_dir(tmp_path):
    assert TABLE.resolve("auto", None, tpu, shape) == ("row_chunks", RowChunks(128))
    with pytest.warns(UserWarning, match="heuristic runs instead"):  # the real table: ignored
      assert loss_impls.OP.resolve("auto", None, tpu, shape) == ("pallas", None)
