"""The ``chunked`` path's one tile (:mod:`kernels.fused_linear.chunked`): tokens per chunk, its
heuristic and the autotuner's grid. The public argument is ``chunk_size``; the tuner's cache records
it as ``ChunkBlocks``."""

from __future__ import annotations

import dataclasses

CHUNKED_LOGITS_BYTES = 1 << 30  # the chunked path's f32 [chunk, V] logits budget


@dataclasses.dataclass(frozen=True)
class ChunkBlocks:
  """The chunked fused LM-head path's one tile: tokens per chunk (``chunk_size``)."""

  chunk_size: int

  def __post_init__(self):
    if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
      raise ValueError(f"ChunkBlocks.chunk_size must be a positive int, got {self.chunk_size!r}")


def default_chunk(n: int, v: int) -> int:
  """Tokens per chunk of the chunked path: a power of two with the f32 [chunk, V] logits under 1 GiB
  (1024 tokens at V = 151936), at least 128 and at most N rounded up to a power of two."""
  chunk = 128
  while chunk * 2 * v * 4 <= CHUNKED_LOGITS_BYTES:
    chunk *= 2
  return max(1, min(chunk, 1 << max(n - 1, 0).bit_length()))


def candidate_blocks(shape: dict, platform: str) -> list[ChunkBlocks]:
  """The tuner's chunk sizes at ``shape`` (tokens, vocab): 512-4096 tokens on GPU, one (<= 128) on
  the others (one size: the plumbing, not a search), each at most the tokens
  rounded up to a power of two and with the f32 [chunk, V] logits within 4 GiB."""
  n_pow2 = 1 << max(shape["tokens"] - 1, 0).bit_length()
  chunks = (512, 1024, 2048, 4096) if platform == "gpu" else (min(n_pow2, 128),)
  return [ChunkBlocks(c) for c in chunks if c <= n_pow2 and c * shape["vocab"] * 4 <= 4 << 30]
