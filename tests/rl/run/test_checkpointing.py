"""Training checkpoints (orbax, rl.run.checkpointing): a damaged newest checkpoint falls back to the
newest intact one, no intact one names each error, and non-finite weights are never written."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _state(seed: int):
  rng = np.random.default_rng(seed)  # random: compressed array files are big enough to truncate
  return {
    "params": {"w": jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)},
    "opt_state": {"mu": jnp.asarray(rng.normal(size=(64, 48)), jnp.float32), "count": jnp.array(3)},
  }


def _truncate(path, keep: float = 0.5):
  data = path.read_bytes()
  path.write_bytes(data[: int(len(data) * keep)])


def _largest_array_file(step_dir):
  files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
  return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize(
  "damage",
  [
    lambda d: _truncate(_largest_array_file(d)),  # tensorstore: a short array chunk
    lambda d: _truncate(d / "meta" / "metadata"),  # a half-written JSON meta
    lambda d: _truncate(d / "state" / "_METADATA"),  # the tree metadata
    lambda d: _largest_array_file(d).write_bytes(b"\0" * _largest_array_file(d).stat().st_size),
  ],
  ids=["array-truncated", "meta-json-truncated", "tree-metadata-truncated", "array-zeroed"],
)
def test_restore_falls_back_to_the_newest_intact_checkpoint(tmp_path, damage):
  from rl.run.checkpointing import Checkpointer

  ckpt = Checkpointer(str(tmp_path / "checkpoints"))
  ckpt.save(2, _state(2), {"step": 2})
  ckpt.save(4, _state(4), {"step": 4})
  damage(tmp_path / "checkpoints" / "4")
  logged = []
  step, state, meta = ckpt.restore_latest(_state(0), log=logged.append)
  assert step == 2 and meta == {"step": 2}
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(_state(2))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert len(logged) == 1 and "skipped checkpoint 4" in logged[0], logged
  # ... and why: tensorstore's status (OUT_OF_RANGE, FAILED_PRECONDITION ...) or the JSON error.
  assert re.search(r"\((ValueError: [A-Z_]+: |JSONDecodeError: )", logged[0]), logged
  # The unreadable one is set aside, so the resumed run can write step 4 again.
  assert ckpt.latest_step() == 2 and list((tmp_path / "checkpoints.corrupt").iterdir())
  ckpt.save(4, _state(5), {"step": 4})
  assert ckpt.restore_latest(_state(0), log=logged.append)[0] == 4
  ckpt.close()


def test_restore_with_no_intact_checkpoint_names_each_error_and_moves_nothing(tmp_path):
  from rl.run.checkpointing import Checkpointer, CheckpointError

  ckpt = Checkpointer(str(tmp_path / "checkpoints"))
  assert ckpt.restore_latest(_state(0)) is None  # empty: a fresh start
  ckpt.save(2, _state(2), {"step": 2})
  _truncate(tmp_path / "checkpoints" / "2" / "meta" / "metadata")
  with pytest.raises(CheckpointError, match=r"step 2: JSONDecodeError"):
    ckpt.restore_latest(_state(0))
  assert (tmp_path / "checkpoints" / "2").exists()
  ckpt.close()


def test_non_finite_weights_are_never_checkpointed(tmp_path):
  from rl.run.checkpointing import Checkpointer, CheckpointError

  ckpt = Checkpointer(str(tmp_path / "checkpoints"))
  state = _state(1)
  state["params"]["w"] = state["params"]["w"].at[3, 5].set(jnp.nan)
  with pytest.raises(CheckpointError, match="NaN"):
    ckpt.save(1, state, {"step": 1})
  assert ckpt.latest_step() is None
  ckpt.close()
