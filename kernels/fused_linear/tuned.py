"""``impl="auto"`` and default tiles of the fused LM-head loss from the autotuner's cache.

``bench.tune`` records, per device kind and (dtype, tokens rounded up to a power of two, hidden,
vocabulary) bucket, the fastest impl that passed parity and its tiles: ``ChunkBlocks`` for
``chunked`` (its ``chunk_size``), ``LinearBlocks`` for ``pallas``, ``MosaicLinearBlocks`` for
``mosaic_gpu``, none for ``xla``. :func:`choose` applies that entry as :mod:`kernels.autotune`'s rule
does for the other ops, and falls back to the heuristics (what the caller passed) when there is no
entry, the cache cannot be read, or the entry is malformed or illegal at this exact shape (the bucket
spans a range of token counts; a hand-edited or stale cache may name fields or impls that no longer
exist): a bad cache must cost speed, never a crash or a wrong kernel.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp

from kernels import autotune, backend
from kernels.backend import Target
from kernels.fused_linear.mosaic_gpu_blocks import DTYPES, MosaicLinearBlocks
from kernels.fused_linear.pallas_blocks import LinearBlocks

OP = "fused_linear"
TUNED_IMPLS = ("xla", "chunked", "pallas", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class Choice:
  """What one call runs: impl and its tiles (``blocks`` for pallas / mosaic_gpu, ``chunk_size`` for
  chunked; None: that impl's heuristic)."""

  impl: str
  blocks: LinearBlocks | MosaicLinearBlocks | None
  chunk_size: int | None


def shape_key(n: int, h: int, v: int, dtype) -> dict:
  """The autotune bucket's fields (``kernels.autotune.bucket("fused_linear", ...)``); v: the
  vocabulary one kernel call sees (one shard's under tensor parallelism)."""
  return dict(dtype=jnp.dtype(dtype).name, tokens=n, hidden=h, vocab=v)


def _legal(choice: Choice, target: Target, shape: dict) -> None:
  """Raise ValueError / TypeError unless ``choice`` can run at ``shape`` on ``target``."""
  if choice.impl not in TUNED_IMPLS:
    raise ValueError(f"tuned impl must be one of {TUNED_IMPLS}, got {choice.impl!r}")
  b = choice.blocks
  if choice.impl == "mosaic_gpu":
    if target.platform != "gpu" or not isinstance(b, MosaicLinearBlocks):
      raise ValueError(f"mosaic_gpu needs a GPU target and MosaicLinearBlocks, got {b!r}")
    b.check(shape["hidden"], shape["dtype"])
  elif choice.impl == "pallas":
    if target.platform == "gpu" and shape["dtype"] in DTYPES:  # pallas means mosaic_gpu there
      if b is not None and not isinstance(b, MosaicLinearBlocks):
        raise TypeError(f"pallas on GPU takes MosaicLinearBlocks, got {b!r}")
      if b is not None:
        b.check(shape["hidden"], shape["dtype"])
    elif b is not None:
      if not isinstance(b, LinearBlocks):
        raise TypeError(f"pallas takes LinearBlocks, got {b!r}")
      b.check(target, shape["tokens"], shape["hidden"], shape["vocab"])
  elif b is not None:
    raise TypeError(f"{choice.impl} takes no blocks, got {b!r}")


def _choice(impl: str, blocks, chunk_size) -> Choice:
  """ChunkBlocks are the chunked path's chunk_size; other tiles are blocks."""
  if isinstance(blocks, autotune.ChunkBlocks):
    return Choice(impl, None, blocks.chunk_size)
  return Choice(impl, blocks, chunk_size)


def from_entry(impl: str, blocks, chunk_size, entry: dict | None, target: Target, shape: dict):
  """:func:`kernels.autotune.apply_checked` for this op -> :class:`Choice`. The caller's
  ``chunk_size`` is its ``ChunkBlocks`` (given tiles stay given). A malformed or illegal entry:
  the caller's arguments, with a warning naming the problem."""
  tiles = blocks
  if tiles is None and chunk_size is not None:
    tiles = autotune.ChunkBlocks(chunk_size)
  legal = lambda i, b: _legal(_choice(i, b, chunk_size), target, shape)
  t_impl, t_blocks = autotune.apply_checked(OP, impl, tiles, entry, legal)
  if (t_impl, t_blocks) == (impl, tiles):  # nothing tuned applies: the caller's own arguments
    return Choice(impl, blocks, chunk_size)
  return _choice(t_impl, t_blocks, chunk_size)


def choose(impl: str, blocks, chunk_size, target: Target, shape: dict) -> Choice:
  """The call's :class:`Choice`: :func:`from_cache` when the target is the host's own, uninterpreted
  platform (as :func:`kernels.autotune.resolve`: one device's timings say nothing about another, nor
  about the interpreter), else the caller's arguments, which the heuristics then fill."""
  if target.interpret or target.platform != backend.host_platform():
    return Choice(impl, blocks, chunk_size)
  return from_cache(impl, blocks, chunk_size, target, shape)


def from_cache(impl: str, blocks, chunk_size, target: Target, shape: dict) -> Choice:
  """:func:`from_entry` with this host's device's cache entry at ``shape`` (none when the cache
  file is missing, unreadable or corrupt: then the caller's arguments, with a warning)."""
  try:
    entry = autotune.lookup(OP, shape)
  except (OSError, ValueError) as e:  # an unreadable or corrupt cache file (JSONDecodeError)
    warnings.warn(f"ignoring the tuning cache ({type(e).__name__}: {e})", stacklevel=3)
    entry = None
  return from_entry(impl, blocks, chunk_size, entry, target, shape)
