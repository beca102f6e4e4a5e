"""Training checkpoints with orbax: parameters + optimizer state + the step, sharded arrays written and
restored in place on every process. (Hugging Face safetensors export is `rl.model.save_checkpoint`.)

Everything else a resumed run needs is a function of the step: the prompts of step s and the rollout
seeds are derived from (train.seed, s), so restoring the step restores the data order and the RNG.

A checkpoint that cannot be read (a truncated array file, a half-written JSON, a tensorstore DATA_LOSS)
is skipped: `restore_latest` falls back to the newest one that restores, says which it skipped and why,
and moves the unreadable ones to `<directory>.corrupt/` so the resumed run can write those steps again.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

__all__ = ["CheckpointError", "Checkpointer"]


class CheckpointError(RuntimeError):
  """No checkpoint restores, or a state that must not be saved (non-finite weights)."""


def _abstract(tree):
  """Shape, dtype and sharding of every array: the target orbax restores into."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@jax.jit
def _all_finite(tree) -> jax.Array:  # -> [] bool: every floating-point value is finite
  flags = [
    jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def _reason(error: BaseException) -> str:
  """The deepest ValueError / OSError's type and first line (else `error`'s): orbax wraps tensorstore's
  OUT_OF_RANGE / DATA_LOSS in an Exception whose own message is a spec dump."""
  chain = [error]
  while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 16:
    chain.append(chain[-1].__cause__ or chain[-1].__context__)
  root = next((e for e in reversed(chain) if isinstance(e, (ValueError, OSError))), error)
  first = str(root).strip().splitlines()[0] if str(root).strip() else ""
  return f"{type(root).__name__}: {first[:300]}"


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
    crash right after never leaves a half-written 'latest' checkpoint. Non-finite weights are refused
    (CheckpointError): a resumable NaN is worse than none."""
    if step in self._manager.all_steps():
      return
    if not bool(_all_finite(state)):
      raise CheckpointError(
        f"refusing to write checkpoint {step} to {self.directory}: the state holds NaN/inf values"
      )
    self._manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    )
    self._manager.wait_until_finished()

  def restore_latest(
    self, like: dict[str, Any], log: Callable[[str], None] = print
  ) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
    """(step, state, meta) of the newest checkpoint that restores, with `like`'s structure and
    shardings; None when there is none. Newer unreadable ones are logged and moved aside; when none
    restores, CheckpointError lists each one's error and nothing is moved."""
    failures: list[tuple[int, str]] = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        out = self._manager.restore(
          step,
          args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(like)), meta=ocp.args.JsonRestore()
          ),
        )
      except Exception as e:  # any failure to read this one means: try the next older one
        failures.append((step, _reason(e)))
        continue
      self._set_aside(failures, log)
      return step, out["state"], out["meta"]
    if failures:
      raise CheckpointError(
        f"no checkpoint in {self.directory} restores: "
        + "; ".join(f"step {s}: {why}" for s, why in failures)
      )
    return None

  def _set_aside(self, failures: list[tuple[int, str]], log: Callable[[str], None]) -> None:
    """Moves unreadable checkpoints to `<directory>.corrupt/<step>-<time>` (kept for inspection; the
    manager would otherwise still count them as saved and never rewrite those steps)."""
    if not failures:
      return
    aside = self.directory + ".corrupt"
    if jax.process_index() == 0:
      os.makedirs(aside, exist_ok=True)
      for step, why in failures:
        target = os.path.join(aside, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(os.path.join(self.directory, str(step)), target)
        log(f"skipped checkpoint {step} ({why}); moved it to {target}")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("rl.run.checkpointing.set_aside")
    self._manager.reload()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
