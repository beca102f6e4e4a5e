"""The autotuner's cache: its file per device kind, its shape buckets, blocks <-> JSON, memoised reads.

The data half of :mod:`kernels.autotune` (which resolves ``impl="auto"`` from it and runs the
search that writes it); nothing here imports the kernels except lazily (the blocks' classes).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import re
from pathlib import Path

import jax

SCHEMA = 1
TUNING_DIR = Path(__file__).parent / "tuning"
OPS = ("grpo_loss", "paged_attention", "optim", "fused_linear")
HEURISTIC = "heuristic"  # the baseline row: what impl="auto" with default blocks runs today

_CACHE_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("tuning_dir", default=None)


@contextlib.contextmanager
def use_cache_dir(path):
  """Read and write tuning caches under ``path`` inside the block (tests; ``bench.device``'s run)."""
  token = _CACHE_DIR.set(Path(path))
  _load.cache_clear()
  try:
    yield
  finally:
    _CACHE_DIR.reset(token)
    _load.cache_clear()


def cache_dir() -> Path:
  return _CACHE_DIR.get() or TUNING_DIR


def device_kind() -> str:
  return jax.devices()[0].device_kind


def cache_path(kind: str, directory: Path | None = None) -> Path:
  slug = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"
  return (directory or cache_dir()) / f"{slug}.json"


# ------------------------------------------------------------------------------------ shape buckets
def _pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def bucket(op: str, shape: dict) -> str:
  """The cache key of one problem. Token / batch / context counts are rounded up to powers of two
  (timings scale smoothly there); vocabulary, heads, head_dim and page size are exact (they change
  which blocks are legal)."""
  if op == "grpo_loss":
    return f"{shape['dtype']}/n{_pow2(shape['tokens'])}/v{shape['vocab']}"
  if op == "paged_attention":
    return (
      f"{shape['dtype']}/b{_pow2(shape['batch'])}/hq{shape['q_heads']}/hkv{shape['kv_heads']}"
      f"/d{shape['head_dim']}/ps{shape['page_size']}/ctx{_pow2(shape['ctx'])}"
    )
  if op == "optim":  # a whole parameter tree per rule: its size decides launch count vs bandwidth
    return f"{shape['rule']}/{shape['dtype']}/p{_pow2(shape['params'])}"
  if op == "fused_linear":
    return f"{shape['dtype']}/n{_pow2(shape['tokens'])}/h{shape['hidden']}/v{shape['vocab']}"
  raise ValueError(f"op must be one of {OPS}, got {op!r}")


# ----------------------------------------------------------------------------------- blocks <-> JSON
@dataclasses.dataclass(frozen=True)
class ChunkBlocks:
  """The chunked fused LM-head path's one tile: tokens per chunk (``chunk_size``)."""

  chunk_size: int

  def __post_init__(self):
    if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
      raise ValueError(f"ChunkBlocks.chunk_size must be a positive int, got {self.chunk_size!r}")


def _blocks_types():
  from kernels.fused_linear.mosaic_gpu_blocks import MosaicLinearBlocks
  from kernels.fused_linear.pallas_blocks import LinearBlocks
  from kernels.grpo_loss.mosaic_gpu_blocks import ClusterLossBlocks, MosaicLossBlocks
  from kernels.grpo_loss.pallas_blocks import LossBlocks
  from kernels.optim.pallas_blocks import ElementwiseBlocks, MultiTensorBlocks
  from kernels.paged_attention.mosaic_gpu_blocks import MosaicPagedBlocks
  from kernels.paged_attention.pallas_blocks import PagedBlocks

  return {
    # TPU tiles (ElementwiseBlocks) or the GPU multi-tensor launch (MultiTensorBlocks)
    ("optim", "pallas"): (ElementwiseBlocks, MultiTensorBlocks),
    ("fused_linear", "pallas"): LinearBlocks,
    ("fused_linear", "mosaic_gpu"): MosaicLinearBlocks,
    ("fused_linear", "chunked"): ChunkBlocks,
    ("grpo_loss", "pallas"): LossBlocks,
    # the row kernel's tiles, or the cluster-split kernels' (rows, cluster, chunk)
    ("grpo_loss", "mosaic_gpu"): (MosaicLossBlocks, ClusterLossBlocks),
    ("paged_attention", "pallas"): PagedBlocks,
    ("paged_attention", "mosaic_gpu"): MosaicPagedBlocks,
  }


def blocks_to_json(blocks) -> dict | None:
  return None if blocks is None else dataclasses.asdict(blocks)


def blocks_from_json(op: str, impl: str, data: dict | None):
  if data is None:
    return None
  types = _blocks_types()[(op, impl)]
  if isinstance(types, tuple):  # one impl, per-backend blocks: the class whose fields the data has
    types = next(c for c in types if set(data) == {f.name for f in dataclasses.fields(c)})
  return types(**data)


# ------------------------------------------------------------------------------------------ reading
def _load_file(path: Path) -> dict | None:
  if not path.exists():
    return None
  data = json.loads(path.read_text())
  if data.get("schema") != SCHEMA:  # an older layout: ignore rather than misread
    return None
  return data


def _load_uncached(kind: str, directory: str) -> dict | None:
  return _load_file(cache_path(kind, Path(directory)))


class _Loader:
  """Memoised cache reads, cleared when the cache directory changes or a cache is written."""

  def __init__(self):
    self._memo: dict[tuple[str, str], dict | None] = {}

  def __call__(self, kind: str) -> dict | None:
    key = (kind, str(cache_dir()))
    if key not in self._memo:
      self._memo[key] = _load_uncached(*key)
    return self._memo[key]

  def cache_clear(self):
    self._memo.clear()


_load = _Loader()


def lookup(op: str, shape: dict, kind: str | None = None) -> dict | None:
  """The cached entry (``winner`` and ``candidates``) of ``op`` at ``shape`` on ``kind``, or None."""
  data = _load(kind or device_kind())
  if data is None:
    return None
  return data.get("entries", {}).get(op, {}).get(bucket(op, shape))
