"""A peer that cannot be installed beside our jax (tokamax 0.0.17 needs jax >= 0.11.1) is a skipped
row with its reason, in the compiled report and in a measured run, never a failure: ``python -m
bench --target tpu-v6e`` exited 1 for the tokamax row that "did not compile" alone."""

import jax.numpy as jnp
import pytest

from bench import report
from bench.kernels import roofline, run
from bench.kernels.cases import Case
from bench.kernels.cases import fused_linear as fl_cases
from bench.tpu import compiled


def _never(*_):
  raise AssertionError("an unavailable case's functions must not run or compile")


def _case(why):
  return Case("peer/x", "tiny", "fwd", lambda seed: (jnp.ones(4),), _never, _never, None, None, (),
              unavailable=lambda: why)  # fmt: skip


def test_unavailable_peer_is_a_skipped_compiled_row_not_a_failure():
  """Catches: the peer's row counted as failed (the report's exit status 1), compiled at all, or
  its reason lost from the row, the run's log line and the summary table."""
  row = compiled.compile_case(_case("peer needs jax>=0.11.1"), "v6e", None)
  assert row["ok"] and row["skipped"] == "peer needs jax>=0.11.1" and not row.get("error")
  assert "skipped (peer needs jax>=0.11.1)" in compiled.describe_row(row)
  assert "| peer/x/tiny/fwd | skipped: peer needs jax>=0.11.1 |" in report.compiled_table([row])


def test_unavailable_peer_is_a_skipped_measured_row():
  """The measured path (a TPU or GPU host): the same skipped row, nothing compiled."""
  peaks = roofline.DevicePeaks(None, None, "test")
  r = run.run_case(_case("not importable"), peaks, memory_limit=0)
  assert r.ok and r.skipped == "not importable" and r.kernel is None


def test_available_case_is_not_skipped():
  """Catches: every case skipped (an ``unavailable`` read as truthy whatever it returns)."""
  case = _case(None)
  assert case.unavailable() is None
  with pytest.raises(AssertionError, match="must not run"):
    case.kernel()


def test_tokamax_row_says_why_where_it_cannot_install():
  """The real peer row: where tokamax does not import (jax 0.10 here), its reason names the jax
  it needs; where it does, the row is a normal one."""
  rows = [c for c in fl_cases.cases("large", "tpu") if c.op == "fused_linear/tokamax"]
  assert rows and all(r.unavailable is fl_cases.tokamax_unavailable for r in rows)
  why = rows[0].unavailable()
  try:
    import tokamax  # noqa: F401
  except ImportError:
    assert why and "jax>=0.11.1" in why
  else:
    assert why is None
