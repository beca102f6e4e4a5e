"""A real compiled report, produced here by libtpu (``nox -s tpu_compile``): every row's modelled time
at or above its case's byte and flop floors, and no negative figure anywhere in its model.

``python -m bench --target tpu-v6e --size tiny`` compiles every kernel suite's tiny cases (the
same code path as the committed bench/results/example-tpu-*-compiled reports, at small shapes), and
one more case compiles the fused head's ``chunked`` path over 4 chunks (a ``lax.scan`` around two
kernels and three matmuls), whose model must count each kernel and matmul 4 times. Skipped without
libtpu (the parser and the model's rules are tested without it in tests/bench/tpu/test_hlo_loops.py).
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from kernels import tpu_targets

ROOT = pathlib.Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(
  not tpu_targets.libtpu_available(), reason="needs libtpu (nox -s tpu_compile)"
)
GEN = "v6e"
RELATIVE = 1e-9  # float rounding of the same quantity computed twice


def _env():
  """A subprocess on this CPU host compiling for TPU (the bench's suite subprocesses add libtpu's
  dump flag themselves)."""
  return dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=str(ROOT))


def _numbers(tree, path=""):
  """(path, value) of every number in a JSON tree."""
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _numbers(v, f"{path}.{k}")
  elif isinstance(tree, list):
    for i, v in enumerate(tree):
      yield from _numbers(v, f"{path}[{i}]")
  elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
    yield path, tree


def _assert_physical(row: dict, gen) -> None:
  """The row's modelled time >= max(ideal bytes / HBM bandwidth, flops / bf16 peak), recomputed
  here from the case's own bytes and flops, and no negative or non-finite figure in its model."""
  m = row["compiled"]["model"]
  for path, value in _numbers(m):
    assert math.isfinite(value) and value >= 0, (row["name"], path, value)
  if m["modelled_s"] is None:  # did not compile: no time claimed
    assert m["why"], row["name"]
    return
  floor = max(
    (row["bytes"] or 0) / gen.hbm_bw,
    (row["flops"] or 0) / gen.bf16_flops,
  )
  assert m["modelled_s"] >= floor * (1 - RELATIVE), (row["name"], m, floor)
  assert m["modelled_s"] >= m["compute_s"] * (1 - RELATIVE), (row["name"], m)


@pytest.mark.timeout(1500)
def test_every_row_of_a_compiled_report_is_at_or_above_its_floors(tmp_path):
  """Catches: a modelled time below what the case's bytes or flops need at the datasheet peaks (a
  loop body counted once), XLA's negative optimal time (the optimizer rows printed -23990.416 ms
  and -154974.996 ms) used or shown as a compute floor, a report that drops rows."""
  out = tmp_path / "report"
  cmd = [sys.executable, "-m", "bench", "--target", f"tpu-{GEN}", "--size", "tiny", "--out",
         str(out), "--no-plots"]  # fmt: skip
  proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=1400)
  assert (out / "results.json").exists(), proc.stderr[-3000:]
  rows = json.loads((out / "results.json").read_text())["cases"]
  suites = {r["op"].split("/")[0] for r in rows}
  assert {"grpo_loss", "fused_linear", "paged_attention", "optim"} <= suites, suites
  gen = tpu_targets.generation(GEN)
  modelled = set()
  for row in rows:
    assert row.get("compiled"), row
    _assert_physical(row, gen)
    if row["compiled"]["model"]["modelled_s"] is not None:
      modelled.add(row["op"].split("/")[0])
  # the tiny paged shapes (head_dim 16) are not TPU-shaped: its rows say why; the paged kernel's
  # model is checked at a TPU-shaped small case below
  assert {"grpo_loss", "fused_linear", "optim"} <= modelled, modelled
  # a negative figure is printed only as XLA gave it, marked as not a time and unused
  summary = (out / "summary.md").read_text()
  for m in re.finditer(r"-\d+\.\d+ ms", summary):
    assert summary[m.end() :].startswith(" (XLA's cost model; not a time, unused)"), m.group(0)


CHUNKED = """
import json, pathlib, sys
import jax, jax.numpy as jnp
import kernels
from bench.tpu import compiled
from bench.kernels.cases import Case
from bench.kernels.cases import fused_linear as fl
from bench.shapes import LinearLossShape

shape = LinearLossShape(2, 256, 256, 1000, "bfloat16")
def kernel(h, w, ids, mask, adv):
  f = lambda h, w: kernels.fused_linear_grpo_loss(h, w, ids, mask, adv, impl="chunked",
                                                  chunk_size=128)[0]
  return jax.value_and_grad(f, argnums=(0, 1))(h, w)
def reference(h, w, ids, mask, adv):
  return jnp.sum(jnp.einsum("bth,hv->btv", h, w, preferred_element_type=jnp.float32))
n, hd, v = 512, 256, 1000
case = Case("fused_linear/chunked", "chunks-of-128", "fwd+bwd", lambda s: fl.make_inputs(shape, s),
            kernel, reference, 2 * (n * hd + hd * v) * 2, 6 * n * hd * v, ())
print(json.dumps(compiled.compile_case(case, "v6e", pathlib.Path(sys.argv[1]))))

from bench.kernels.cases import paged_attention as pa
from bench.shapes import PagedShape
paged = PagedShape(4, 16, 2, 128, 512, 16, "bfloat16")  # decode-4k's layer, 4 sequences of <= 512
(case,) = [c for c in pa.cases("tiny", "tpu") if c.op == "paged_attention/pallas"]
case = Case(case.op, "tpu-small", "fwd", lambda s: pa.make_inputs(paged, s), case.kernel,
            case.reference, paged.kv_bytes() + 2 * 4 * 16 * 128 * 2,
            4 * sum(paged.lengths()) * 16 * 128, ())
print(json.dumps(compiled.compile_case(case, "v6e", pathlib.Path(sys.argv[1]))))
"""


@pytest.mark.timeout(900)
def test_scan_of_kernels_counted_per_trip(tmp_path):
  """Catches: the chunked path's kernels and matmuls counted once per program instead of once per
  chunk (4 here), which modelled the production rows below their flop floor. The paged decode
  kernel at a TPU-shaped small case (head_dim 128) is held to its floors too."""
  from bench.tpu import schedule as tpu_schedule

  dump = tmp_path / "dump"
  dump.mkdir()
  env = tpu_schedule.dump_env(dump)
  env["PYTHONPATH"] = str(ROOT)
  proc = subprocess.run([sys.executable, "-c", CHUNKED, str(dump)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=800)  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  row, paged = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
  assert paged["compiled"]["model"]["modelled_s"], paged["compiled"]["kernel"]
  _assert_physical(paged, tpu_targets.generation("v6e"))
  side = row["compiled"]["kernel"]
  assert side["loops"]["trips"] == [4]
  names = sorted(k["name"].split(".")[0] for k in side["kernels"])
  assert names == ["grpo_loss_bwd", "grpo_loss_fwd"]
  assert all(side["loops"]["kernels"][k["name"]] == 4 for k in side["kernels"])
  assert side["loops"]["uncounted_dot_flops"] == 3 * (3 * 2 * 128 * 256 * 1000)
  gen = tpu_targets.generation("v6e")
  _assert_physical(row, gen)
  once = sum(
    tpu_schedule.KernelSchedule(**{f: k[f] for f in ("name", "total_bundles", "grid",
                                                     "step_bundles", "loops")}).modelled_seconds(gen.clock_hz)
    for k in side["kernels"]
  )  # fmt: skip
  assert row["compiled"]["model"]["compute_s"] >= 4 * once
