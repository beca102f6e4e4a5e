"""bench.memory: the two updates' XLA memory analysis at tiny shapes."""

import pytest

from bench import memory


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
