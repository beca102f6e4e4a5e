"""Where a kernel runs and how it is lowered: the one place that looks at the platform.

Every op asks :func:`resolve` for a :class:`Target` and passes it down; nothing below this module calls
``jax.default_backend()``. That is what lets a CPU host lower the real TPU (Mosaic) and CUDA (Triton)
kernels ahead of time: the target is a value, chosen by an argument or by :func:`use_target`.

Kernel families (a kernel module implements each):
  * ``tiled``:   a (rows, vocab) grid whose last axis is a sequential reduction with VMEM scratch —
                 the Mosaic TPU shape. The CPU interpreter runs the same family.
  * ``rowloop``: one program per row with a ``fori_loop`` over vocabulary chunks and masked loads and
                 stores — the Triton shape (GPU programs are independent, so no grid-axis reduction).

Also here: per-backend compiler params and the jax 0.10 / 0.11 shims (every ``jax`` version or
``hasattr`` check in the project belongs in this module), the abstract GPU that lets a GPU-less host
lower for CUDA under jax 0.11 (:func:`abstract_gpu`), and the TPU generation a target compiles for
(:mod:`kernels.tpu_targets`: the generations' VMEM / HBM / peaks and abstract slices for deviceless
compiles, e.g. ``backend.tpu_devices("v6e-8")``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from typing import Literal

import jax

from kernels import tpu_targets
from kernels.tpu_targets import GENERATIONS as TPU_GENERATIONS
from kernels.tpu_targets import Generation as TpuGeneration
from kernels.tpu_targets import Slice as TpuSlice
from kernels.tpu_targets import devices as tpu_devices

__all__ = [  # the TPU table is re-exported: callers ask backend, the one module that knows platforms
  "TPU_GENERATIONS",
  "Target",
  "TpuGeneration",
  "TpuSlice",
  "make_target",
  "resolve",
  "tpu_devices",
  "use_target",
]

Platform = Literal["tpu", "gpu", "cpu"]
PLATFORMS: tuple[str, ...] = ("tpu", "gpu", "cpu")

# GPU Pallas lowering. Upstream is moving from Triton to Mosaic GPU (jax 0.11 warns that Triton is
# deprecated); Triton is what works today on both H100 and older parts. Change it here, nowhere else.
GPU_LOWERING: Literal["triton"] = "triton"

# The custom-call names the real (non-interpreted) kernels lower to; tests assert on them.
LOWERED_KERNEL_MARKERS = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


@dataclasses.dataclass(frozen=True)
class Target:
  """A kernel target: the platform whose kernel family and lowering to use, and whether to interpret."""

  platform: Platform
  interpret: bool = False
  # The TPU generation compiled for ("v4", "v6e", ...; tpu only). None: not known (a plain "tpu"
  # lowering): heuristics then size for every generation (the smallest VMEM).
  generation: str | None = None

  def __post_init__(self):
    if self.platform not in PLATFORMS:
      raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")
    if self.platform == "cpu" and not self.interpret:
      raise ValueError("CPU has no Pallas lowering: the cpu target always runs in interpret mode")
    if self.generation is not None:
      if self.platform != "tpu":
        raise ValueError(f"generation={self.generation!r} is for the tpu platform, not {self.platform!r}")  # fmt: skip
      object.__setattr__(self, "generation", tpu_targets.generation(self.generation).name)

  @property
  def tpu(self) -> TpuGeneration | None:
    """The TPU generation's figures (None when not a TPU target or the generation is unknown)."""
    return tpu_targets.generation(self.generation) if self.generation else None

  @property
  def vmem_bytes(self) -> int:
    """The VMEM a TPU kernel of this target may plan for: its generation's, else every generation's
    smallest (v4's 16 MiB), so that an unnamed TPU target compiles everywhere."""
    return self.tpu.vmem_bytes if self.tpu else tpu_targets.SMALLEST_VMEM

  @property
  def family(self) -> Literal["tiled", "rowloop"]:
    return "rowloop" if self.platform == "gpu" else "tiled"

  @property
  def lowering_platform(self) -> str:
    """The name ``jax.jit(...).lower(lowering_platforms=...)`` expects."""
    return {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}[self.platform]


def host_platform() -> Platform:
  """The platform of jax's default backend, as a :data:`Platform`."""
  name = jax.default_backend()
  if name in ("gpu", "cuda", "rocm"):
    return "gpu"
  if name == "tpu":
    return "tpu"
  return "cpu"


_TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
  "kernel_target", default=None
)


@contextlib.contextmanager
def use_target(platform: Platform, interpret: bool | None = None, generation: str | None = None):
  """Make ``platform`` the default target of every op called inside the block.

  ``interpret`` defaults to True only for ``cpu``. Example (lower the TPU kernel on a CPU host)::

      with use_target("tpu"):
        jax.jit(f).trace(*specs).lower(lowering_platforms=("tpu",))

  A real (non-interpreted) GPU target on a host without a GPU also enters :func:`abstract_gpu`, so that
  tracing and lowering inside the block can lower the GPU kernels for CUDA.
  """
  target = make_target(platform, interpret, generation)
  token = _TARGET.set(target)
  try:
    real_gpu = target.platform == "gpu" and not target.interpret
    with abstract_gpu() if real_gpu else contextlib.nullcontext():
      yield
  finally:
    _TARGET.reset(token)


# The GPU a GPU-less host lowers for: the production part (sm_90). jax 0.11's Triton lowering asks the
# default device for its compute capability, which a CPU host lacks; an abstract device answers instead.
ABSTRACT_GPU_KIND = "NVIDIA H100 80GB HBM3"
ABSTRACT_GPU_CORES = 132


@contextlib.contextmanager
def abstract_gpu(device_kind: str = ABSTRACT_GPU_KIND, num_cores: int = ABSTRACT_GPU_CORES):
  """Lower GPU kernels inside the block as if for ``device_kind`` (a no-op on a host with a GPU).

  jax >= 0.11 reads the target GPU from ``jax.sharding.use_abstract_mesh``'s abstract device when the
  default device is not a GPU; jax 0.10 needs nothing, and accepts the same context. Wrap both
  ``.trace`` and ``.lower`` (or use :func:`use_target`)::

      with backend.abstract_gpu():
        jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))
  """
  if host_platform() == "gpu":
    yield
    return
  from jax.sharding import AbstractDevice, AbstractMesh

  device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
  mesh = AbstractMesh((1,), ("_abstract_gpu",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def make_target(
  platform: Platform, interpret: bool | None = None, generation: str | None = None
) -> Target:
  """A target; on a TPU host a tpu target without ``generation`` gets the host's."""
  if platform == "tpu" and generation is None and host_platform() == "tpu":
    host = tpu_targets.generation_of_kind(jax.devices()[0].device_kind)
    generation = host.name if host else None
  return Target(platform, platform == "cpu" if interpret is None else interpret, generation)


def resolve(platform: Platform | None = None, interpret: bool | None = None) -> Target:
  """The target for one call: explicit arguments, else :func:`use_target`, else the host's backend."""
  if platform is not None:
    ctx = _TARGET.get()
    same = ctx is not None and ctx.platform == platform
    return make_target(platform, interpret, ctx.generation if same else None)
  ctx = _TARGET.get()
  if ctx is not None:
    return ctx if interpret is None else dataclasses.replace(ctx, interpret=interpret)
  return make_target(host_platform(), interpret)


# ----------------------------------------------------------------------------- version shims
def _tpu_module():
  from jax.experimental.pallas import tpu as pltpu

  return pltpu


def _triton_module():
  with warnings.catch_warnings():  # jax 0.11 warns on import that the Triton backend is deprecated
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pltriton
  return pltriton


def compiler_params(
  target: Target,
  *,
  dimension_semantics=None,
  num_warps=None,
  num_stages=None,
  vmem_limit_bytes=None,
  disable_bounds_checks=False,
):
  """Per-backend compiler params for ``pallas_call`` (None when interpreting). ``disable_bounds_checks``
  (TPU): drop Mosaic's per-DMA address checks, only for kernels whose DMA addresses are validated."""
  if target.interpret:
    return None
  if target.platform == "tpu":
    pltpu = _tpu_module()
    cls = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
    kw = {}
    if dimension_semantics is not None:
      kw["dimension_semantics"] = tuple(dimension_semantics)
    if vmem_limit_bytes is not None:
      kw["vmem_limit_bytes"] = int(vmem_limit_bytes)
    if disable_bounds_checks:
      kw["disable_bounds_checks"] = True
    return cls(**kw)
  pltriton = _triton_module()
  cls = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams
  kw = {}
  if num_warps is not None:
    kw["num_warps"] = int(num_warps)
  if num_stages is not None:
    kw["num_stages"] = int(num_stages)
  return cls(**kw)


def tpu_smem():
  """The TPU scalar memory space (``pltpu.SMEM``), for kernels that keep scalars there."""
  return _tpu_module().SMEM


def scratch_vmem(shape, dtype):
  """A VMEM scratch buffer (the tiled family's accumulators; the interpreter accepts it too)."""
  return _tpu_module().VMEM(shape, dtype)


def masked_load(ref, *, mask, other):
  """Triton-style masked load (rowloop family); ``pl.load`` in older jax, ``triton.load`` now."""
  return _triton_module().load(ref, mask=mask, other=other)


def masked_store(ref, value, *, mask):
  return _triton_module().store(ref, value, mask=mask)


# ------------------------------------------------------------------------ Mosaic GPU (impl="mosaic_gpu")
# The GPU lowering is chosen per call by ``impl``: "pallas" is the Triton kernel (rowloop family), and
# "mosaic_gpu" the Mosaic GPU kernel (TMA pipelines into shared memory, warpgroup layouts). This table
# is the one switch: the custom call each lowers to, which tests assert on.
GPU_LOWERINGS = {"pallas": "triton", "mosaic_gpu": "mosaic"}
MOSAIC_GPU_MARKER = "mosaic_gpu_v2"


def mosaic_gpu_module():
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu


def check_mosaic_gpu_target(target: Target) -> None:
  """The Mosaic GPU kernels run on a GPU or in the Mosaic GPU interpreter (any host), never on TPU."""
  if target.platform == "tpu":
    raise ValueError("impl='mosaic_gpu' is a GPU kernel; on TPU use impl='pallas' (Mosaic TPU)")


def mosaic_gpu_interpret(target: Target):
  """``interpret=`` for ``plgpu.kernel``: the Mosaic GPU interpreter (simulated shared memory, threads,
  barriers; jax >= 0.10) when the target interprets, else None (compile for the GPU)."""
  if not target.interpret:
    return None
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return InterpretGPUParams()


def mosaic_gpu_kernel(body, *, target: Target, out_type, scratch_types=(), grid, grid_names):
  """``plgpu.kernel`` (``pl.pallas_call`` is deprecated for Mosaic GPU) for ``target``."""
  plgpu = mosaic_gpu_module()
  return plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types=scratch_types,
    grid=grid,
    grid_names=grid_names,
    interpret=mosaic_gpu_interpret(target),
  )


def layout_cast(x, layout, target: Target):
  """``plgpu.layout_cast``; the identity in the interpreter, which has no register layouts (and no
  lowering rule for the cast)."""
  if target.interpret:
    return x
  return mosaic_gpu_module().layout_cast(x, layout)


def smem_transforms(dtype, target: Target) -> tuple:
  """(8, 128 bytes) tiles with the 128-byte swizzle: the shared-memory layout that a WGMMA-layout
  register load / store or a wgmma operand reads without bank conflicts."""
  plgpu = mosaic_gpu_module()
  cols = 128 // jax.numpy.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(128))


# jax 0.10's Mosaic GPU interpreter cannot read a transposed shared-memory operand in wgmma
# (``TransposeTransform`` has no ``indices``); jax 0.11's can. Kernels take a plain-dot path there.
INTERPRETER_TRANSPOSED_WGMMA = JAX_VERSION >= (0, 11)


# ----------------------------------------------------------------- the TPU interpreter's race state
# jax's TPU interpreter (``pltpu.InterpretParams(detect_races=True)``) reports races only in a private
# module global: ``races`` (a ``RaceDetectionState``: ``races_found``, and per simulated buffer the
# reads and writes it saw) of this module, in jax 0.10.x and 0.11.x alike. It holds the last
# interpreted kernel's state (each kernel call starts a fresh one).
TPU_INTERPRET_RACES = ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "races")
TPU_INTERPRET_RACES_JAX = ("0.10", "0.11")  # the versions it was read from


@dataclasses.dataclass(frozen=True)
class InterpretRaces:
  """What the TPU interpreter saw in the last kernel it ran: whether it found a race, and which
  simulated cores touched their own VMEM / SMEM (a core that ran no grid step touches none)."""

  found: bool
  cores: frozenset[int]


def tpu_interpret_races() -> InterpretRaces:
  """The last interpreted TPU kernel's race state; a RuntimeError naming the jax versions it was
  read from when this jax keeps it elsewhere (the flag is private to jax: never silently absent)."""
  import importlib

  module, name = TPU_INTERPRET_RACES
  mod = importlib.import_module(module)
  if getattr(mod, name, False) is None:  # the global exists, no kernel has run in the interpreter
    raise RuntimeError("no kernel has run in the TPU interpreter (force_tpu_interpret_mode)")
  state = getattr(mod, name, None)
  buffers = (getattr(state, "reads", None), getattr(state, "writes", None))
  if not isinstance(getattr(state, "races_found", None), bool) or None in buffers:
    raise RuntimeError(
      f"jax {jax.__version__}: the TPU interpreter's race state is not at {module}.{name}"
      f".races_found / .reads / .writes, where jax {' and '.join(TPU_INTERPRET_RACES_JAX)} keep "
      "it: find where this jax keeps it and update kernels.backend.TPU_INTERPRET_RACES"
    )
  # a buffer key is (memory space, buffer id, device id, core id); HBM buffers are core 0's
  cores = {k[3] for acc in buffers for k in acc if str(k[0]) in ("vmem", "smem")}
  return InterpretRaces(state.races_found, frozenset(int(c) for c in cores))
