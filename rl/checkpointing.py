"""Training checkpoints with orbax: parameters + optimizer state + the step, sharded arrays written and
restored in place on every process. (Hugging Face safetensors export is `rl.model.save_checkpoint`.)

Everything else a resumed run needs is a function of the step: the prompts of step s and the rollout
seeds are derived from (train.seed, s), so restoring the step restores the data order and the RNG.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def _abstract(tree):
  """Shape, dtype and sharding of every array: the target orbax restores into."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
  """`save(step, state)` every `every` steps (and when forced); `restore_latest(like)`."""

  def __init__(self, directory: str, every: int = 0, max_to_keep: int = 2):
    self.every = every
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
      self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def due(self, step: int) -> bool:
    return self.every > 0 and step % self.every == 0

  def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Writes `state` (a pytree of jax arrays) and a small JSON `meta`; blocks until written, so a
    crash right after never leaves a half-written 'latest' checkpoint."""
    if step in self._manager.all_steps():
      return
    self._manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    )
    self._manager.wait_until_finished()

  def restore_latest(
    self, like: dict[str, Any]
  ) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
    """(step, state, meta) of the newest checkpoint, restored with `like`'s structure and shardings;
    None when there is none."""
    step = self._manager.latest_step()
    if step is None:
      return None
    out = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_abstract(like)), meta=ocp.args.JsonRestore()
      ),
    )
    return step, out["state"], out["meta"]

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
