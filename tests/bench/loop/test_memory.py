"""bench.loop.memory: the two updates' XLA memory analysis at tiny shapes."""

import pytest

from bench.loop import memory


def test_update_memory_scales_with_the_batch_and_the_critic_is_small():
  """The analysis must see the batch (4x the rows: more temporaries) and the value head must cost
  [M, C]-sized arrays, not an [M, C, V] one (at V = 384 that would be hundreds of KiB here)."""
  small = memory.update_memory("tiny", 2, 8, 8, dtype="float32")
  big = memory.update_memory("tiny", 8, 8, 8, dtype="float32")
  for r in (small, big):
    for update in ("grpo", "ppo"):
      assert r[update]["temp_bytes"] > 0 and r[update]["argument_bytes"] > 0
  assert big["grpo"]["temp_bytes"] > small["grpo"]["temp_bytes"]
  extra = big["ppo"]["peak_bytes"] - big["grpo"]["peak_bytes"]
  assert 0 < extra < 8 * 8 * 384 * 4, extra
  assert "The critic's cost" in memory.markdown(big)


def test_bad_shapes_are_refused():
  with pytest.raises(ValueError, match="micro_batch must be an int >= 1"):
    memory.update_memory("tiny", 0, 8, 8)


# ------------------------------------------------------------------------- memory between cases
def test_a_case_leaves_no_live_arrays_behind():
  """Catches a case that keeps its inputs / outputs alive into the next one (on the H100, AdamW at the
  1.5B shape ran out of memory after earlier cases): live arrays return to the baseline."""
  import jax

  from bench.kernels.cases import all_cases
  from bench.kernels.roofline import DevicePeaks
  from bench.kernels.run import run_case

  case = next(c for c in all_cases("tiny", "cpu", ("grpo_loss",)) if c.mode == "fwd+bwd")
  run_case(case, DevicePeaks(None, None, "none"), repeats=1, warmup=0)  # warm caches, constants
  baseline = len(jax.live_arrays())
  r = run_case(case, DevicePeaks(None, None, "none"), repeats=1, warmup=0)
  assert r.ok and r.kernel is not None
  assert len(jax.live_arrays()) == baseline


def test_a_case_that_cannot_fit_is_skipped_before_any_allocation():
  """Catches an OOM instead of a skip: XLA's memory analysis (compiled from abstract inputs) is
  compared with the limit before the inputs exist; the row says why and is not a failure."""
  from bench.kernels.cases import all_cases
  from bench.kernels.roofline import DevicePeaks
  from bench.kernels.run import run_case

  case = next(c for c in all_cases("tiny", "cpu", ("grpo_loss",)))
  import jax

  run_case(case, DevicePeaks(None, None, "none"), repeats=1, warmup=0, memory_limit=1024)
  before = len(jax.live_arrays())
  r = run_case(case, DevicePeaks(None, None, "none"), repeats=1, warmup=0, memory_limit=1024)
  assert (
    r.ok
    and r.kernel is None
    and "by XLA's memory analysis" in r.skipped
    and "> the device's" in r.skipped
  )
  assert len(jax.live_arrays()) == before  # nothing was allocated for the skipped case
  fits = run_case(case, DevicePeaks(None, None, "none"), repeats=1, warmup=0, memory_limit=2**40)
  assert fits.kernel is not None and fits.skipped is None
