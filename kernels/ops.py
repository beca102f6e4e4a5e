"""The op protocol: how an op package declares its implementations, in one table.

Each op package (``kernels/grpo_loss``, ``fused_linear``, ``paged_attention``, ``optim``) has an
``impls.py`` whose ``OP`` is an :class:`Op`: the op's name, its ``IMPLEMENTATIONS`` (the public
``impl=`` string -> :class:`Impl`: the backend modules, the blocks classes, the heuristic, the
tuner's candidates and the legality rule), the tuning cache's shape bucket, and what ``impl="auto"``
runs per platform when no tuned entry applies. The op's public function checks ``impl`` against the
table, resolves it (:meth:`Op.resolve`: the tuned cache, then ``auto``'s platform default), checks
the blocks with the impl's ``supported_on`` and calls it. The tuner (:mod:`kernels.autotune` and
``bench.tune``), the bench and rl's loss config read the same table; nothing in kernels/ lists the
ops (the bench's tuner, which needs them all, imports each one's ``OP``).

Adding a backend to an op touches only that op's folder: its kernel file(s) and one row in its
``impls.py`` (docs/ops.md walks through one).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from kernels import autotune, checks
from kernels.backend import PLATFORMS, Target

Blocks = Any  # a frozen dataclass of tile sizes (or None: the impl's heuristic)


def pow2(x: int) -> int:
  """x rounded up to a power of two: the shape buckets' token / batch / context counts (timings
  scale smoothly there; the dimensions that decide which blocks are legal stay exact)."""
  return 1 << max(int(x) - 1, 0).bit_length()


def no_blocks(target: Target, shape: dict) -> None:
  """The heuristic of an impl without tiles."""
  del target, shape


def heuristic_only(shape: dict, platform: str) -> list:
  """The tuner's candidates of an impl without a grid: its heuristic (blocks None)."""
  del shape, platform
  return [None]


def anywhere(target: Target, shape: dict, blocks: Blocks) -> None:
  """The legality rule of an impl that runs every shape on every target it is offered on."""
  del target, shape, blocks


@dataclasses.dataclass(frozen=True)
class Impl:
  """One row of an op's ``IMPLEMENTATIONS``: an implementation behind one public ``impl=`` string.

  modules: the backend modules holding its kernels (``reference.py`` for ``xla``).
  blocks: the blocks / config classes it takes (empty: none); the tuner's JSON is read back into
    them (the class whose fields the data has).
  platforms: where it is offered ("cpu": in an interpreter): rl's ``train.policy_loss_impl``
    choices and the tuner's candidates per platform.
  heuristic: ``(target, shape) -> blocks``, its default blocks at the tuner's ``shape`` dict.
  candidates: ``(shape, platform) -> [blocks, ...]``, what the tuner tries (None: the heuristic);
    ``[]`` where it offers none.
  supported_on: ``(target, shape, blocks) -> None | reason``: why it cannot run with ``blocks``
    (None: its heuristic's) at ``shape`` on ``target``, checked before anything compiles.
  run: how the op's public function calls it, in the op's own terms (each op's ``impls.py`` says:
    ``grpo_loss`` passes one validated ``Call``).
  """

  modules: tuple[ModuleType, ...]
  blocks: tuple[type, ...] = ()
  platforms: tuple[str, ...] = PLATFORMS
  heuristic: Callable[[Target, dict], Blocks] = no_blocks
  candidates: Callable[[dict, str], list] = heuristic_only
  supported_on: Callable[[Target, dict, Blocks], str | None] = anywhere
  run: Callable | None = None

  def check_blocks_type(self, name: str, blocks: Blocks) -> None:
    """TypeError unless ``blocks`` is None or one of this impl's blocks classes."""
    if blocks is None or isinstance(blocks, self.blocks):
      return
    if not self.blocks:
      raise TypeError(f"impl={name!r} takes no blocks, got {blocks!r}")
    names = " or ".join(c.__name__ for c in self.blocks)
    raise TypeError(f"blocks for impl={name!r} must be {names}, got {type(blocks)}")


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
  """An op's table: ``implementations`` (the public ``impl=`` strings, in the order error messages
  list them), ``bucket(shape) -> str`` (the tuning cache's key of a shape), ``auto`` (platform ->
  the impl ``impl="auto"`` runs without a tuned entry), ``reference`` (the impl that defines the
  op: the tuner and the bench check every other one against it) and ``tuning_order`` (the order the
  tuner tries the impls in, which matters once an op's time budget runs out; default: the
  reference, then the table's order)."""

  name: str
  implementations: Mapping[str, Impl]
  bucket: Callable[[dict], str]
  auto: Mapping[str, str]
  reference: str = "xla"
  tuning_order: tuple[str, ...] = ()

  def __post_init__(self):
    unknown = {i for i in (*self.auto.values(), self.reference) if i not in self.implementations}
    if unknown or set(self.auto) != set(PLATFORMS):
      raise ValueError(
        f"{self.name}: auto must map {PLATFORMS} to implementations, got {self.auto}"
      )

  def __str__(self) -> str:
    return self.name

  @property
  def choices(self) -> tuple[str, ...]:
    """Every public ``impl=`` string: ``"auto"`` and the table's."""
    return ("auto", *self.implementations)

  def __getitem__(self, impl: str) -> Impl:
    return self.implementations[impl]

  def check(self, impl: str, name: str = "impl") -> None:
    """ValueError naming the choices unless ``impl`` is one of them."""
    checks.choice(name, impl, self.choices)

  def on(self, platform: str) -> tuple[str, ...]:
    """The implementations that run on ``platform``, in table order."""
    return tuple(n for n, i in self.implementations.items() if platform in i.platforms)

  def default(self, impl: str, target: Target) -> str:
    """``impl``, with ``"auto"`` replaced by the platform's default."""
    return self.auto[target.platform] if impl == "auto" else impl

  def resolve(self, impl: str, blocks: Blocks, target: Target, shape: dict):
    """(impl, blocks) for one call: the tuned cache's entry for ``shape`` on ``target``'s device
    kind (:func:`kernels.autotune.resolve`; an entry this table rejects is ignored with a
    warning), then ``impl="auto"`` replaced by the platform's default. Blocks None: the impl's
    heuristic, which the caller fills."""
    impl, blocks = autotune.resolve(self, impl, blocks, target, shape)
    return self.default(impl, target), blocks

  # ------------------------------------------------------------------ what the tuner's cache needs
  def blocks_from_json(self, impl: str, data: dict | None) -> Blocks:
    """The blocks a cache entry recorded for ``impl`` (None: none): the impl's class whose fields
    the data has. KeyError for an impl that is not in the table or takes no blocks."""
    if data is None:
      return None
    classes = self.implementations[impl].blocks
    if not classes:
      raise KeyError(f"{self.name} impl {impl!r} takes no blocks, got {data}")
    fits = [c for c in classes if set(data) == {f.name for f in dataclasses.fields(c)}]
    if len(classes) > 1 and not fits:
      raise TypeError(f"{data} are the fields of none of {[c.__name__ for c in classes]}")
    return (fits or classes)[0](**data)

  def check_tuned(self, target: Target, shape: dict) -> Callable[[str, Blocks], None]:
    """``legal(impl, blocks)`` for :func:`kernels.autotune.apply_checked`: ValueError / TypeError
    unless a tuned (impl, blocks) is in this table, runs on ``target``'s platform, takes blocks of
    that type and is supported there (``supported_on``)."""

    def legal(impl: str, blocks: Blocks) -> None:
      if impl not in self.implementations:
        raise ValueError(f"tuned impl must be one of {tuple(self.implementations)}, got {impl!r}")
      entry = self.implementations[impl]
      if target.platform not in entry.platforms:
        raise ValueError(f"{impl} does not run on {target.platform} ({entry.platforms})")
      entry.check_blocks_type(impl, blocks)
      reason = entry.supported_on(target, shape, blocks)
      if reason is not None:
        raise ValueError(reason)

    return legal

  def candidates(self, shape: dict, platform: str) -> list[tuple[str, Blocks]]:
    """(impl, blocks) the tuner tries at ``shape`` on ``platform``: each impl offered there with its
    candidate blocks, in ``tuning_order``."""
    names = self.tuning_order or (self.reference, *(n for n in self.implementations if n != self.reference))  # fmt: skip
    return [
      (name, blocks)
      for name in names
      if platform in self.implementations[name].platforms
      for blocks in self.implementations[name].candidates(shape, platform)
    ]


def fallback(op: Op, impl: str, reason: str | None, stacklevel: int = 3) -> str:
  """``impl`` where the kernel's blocks are legal (``reason`` None); else ``impl="auto"`` falls back
  to the op's reference with a warning naming the reason, and an explicit impl is a ValueError: a
  kernel that cannot compile here is refused before anything compiles, never a compile error."""
  if reason is None:
    return impl
  if impl != "auto":
    raise ValueError(f"{op.name}(impl={impl!r}): {reason}")
  msg = f"{op.name}: the kernel cannot run here ({reason}); impl='auto' runs the XLA reference"
  warnings.warn(msg, stacklevel=stacklevel)
  return op.reference
