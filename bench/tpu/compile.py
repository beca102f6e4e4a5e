"""Every TPU kernel case through libtpu's real compiler, per generation, alone and in sharded programs.

The one list of compile cases (:data:`CASES`: production shapes from :mod:`bench.shapes`, the option
sets of ``tests/kernels/test_lowering.py``) that ``tests/bench/tpu/test_compile.py`` (``nox -s tpu_compile``)
compiles for v4, v5e, v5p, v6e and v7x, and that ``python -m bench.tpu.compile`` prints as a table.
A case builds its function and argument shapes for a :class:`kernels.sharding.KernelSharding` (or
none: one chip); :func:`compile_case` places them on a generation's abstract devices
(:func:`kernels.backend.tpu_devices`) and runs ``jit(...).trace().lower().compile()`` inside
``backend.use_target("tpu", interpret=False, generation=...)``: Mosaic's legality and VMEM checks and
XLA's partitioner run as on the chip. Nothing executes; every figure is *compiled*.

Needs libtpu (``pip install "jax[tpu]==<jax>"``) and, on a host without a TPU, ``JAX_PLATFORMS=cpu``
and ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` in the environment (``nox -s tpu_compile`` sets both).

    python -m bench.tpu.compile                       # every case x generation, then the sharded ones
    python -m bench.tpu.compile --gen v4 --case grpo  # a selection (substring of the case name)
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import kernels
from bench.shapes import (
  LARGE_VOCAB_LOSS_SHAPES,
  LINEAR_LOSS_SHAPES,
  LOSS_SHAPES,
  PAGED_SHAPES,
  PRODUCTION_LINEAR_LOSS_SHAPES,
  PRODUCTION_LOSS_SHAPES,
  PRODUCTION_PAGED_SHAPES,
  decoder_param_shapes,
)
from kernels import backend
from kernels.sharding import KernelSharding

GENERATIONS = ("v4", "v5e", "v5p", "v6e", "v7x")
SHARDED_SLICE = "v6e-4"  # the sharded programs' slice: 4 chips, one host
MARKER = backend.LOWERED_KERNEL_MARKERS["tpu"]  # a Mosaic kernel in the compiled HLO

# An argument: (shape, dtype, partition spec over the case's mesh; None = replicated).
Arg = tuple[tuple[int, ...], str, P | None]


@dataclasses.dataclass(frozen=True)
class CompileCase:
  """One kernel call to compile: ``build(sharding)`` -> (function, its arguments as :data:`Arg`).

  ``mesh_axes``: the sharded program's mesh over :data:`SHARDED_SLICE` (axis name -> size) and
  ``sharding``: which of them the kernel is told about (``KernelSharding`` fields); ``kernels``: the
  Mosaic calls the compiled program must hold (each shard runs the same ones)."""

  name: str  # "grpo_loss/qwen2.5-8k/fwd+bwd"
  op: str  # grpo_loss | fused_linear | paged_attention | optim
  build: Callable[[KernelSharding | None], tuple[Callable, list[Arg]]]
  kernels: int
  mesh_axes: tuple[tuple[str, int], ...] = (("dp", 2), ("fsdp", 2))
  sharding: tuple[tuple[str, object], ...] = (("batch_axes", ("dp", "fsdp")),)
  kernels_on: tuple[tuple[str, int], ...] = ()  # (generation, Mosaic calls) where not ``kernels``

  def kernels_for(self, generation: str | None) -> int:
    """The Mosaic calls expected on one chip of ``generation`` (None: the sharded slice's)."""
    return dict(self.kernels_on).get(generation, self.kernels)

  def kernel_sharding(self, devices) -> KernelSharding:
    names, sizes = zip(*self.mesh_axes)
    mesh = Mesh(np.asarray(devices[: int(np.prod(sizes))]).reshape(sizes), names)
    return KernelSharding(mesh, **dict(self.sharding))


# ------------------------------------------------------------------------------------ grpo_loss
def _rows(sh: KernelSharding | None, *rest) -> P | None:
  """The spec of a [B, ...] argument: B over the batch axes."""
  return None if sh is None else P(sh.batch_axes or None, *rest)


def _loss_case(shape_name: str, mode: str, **options) -> Callable:
  """fwd | fwd+bwd | aux (the gradient also through aux.per_token_kl: the three-pass backward);
  ``support_gap=True``: a [B, T] f32 support gap argument too (the kernels gap their sweeps)."""
  s = LOSS_SHAPES[shape_name]
  on_policy = options.pop("on_policy", False)
  beta = options.pop("beta", 0.04)
  gapped = options.pop("support_gap", False)

  def build(sh):
    b, t, v = s.batch, s.seq, s.vocab
    args = [((b, t, v), s.dtype, _rows(sh, None, None)), ((b, t), "int32", _rows(sh, None))]
    args += [((b, t), "bool", _rows(sh, None)), ((b,), "float32", _rows(sh))]
    args += [((b, t), "float32", _rows(sh, None))] * (4 if gapped else 3)

    def loss(logits, ids, mask, adv, old, ref, sampler, gap=None):
      loss, aux = kernels.grpo_loss(
        logits, ids, mask, adv, impl="pallas", sharding=sh, beta=beta,
        old_logps=None if on_policy else old, ref_logps=ref,
        sampler_logps=sampler if options.get("is_mode") else None, support_gap=gap, **options,
      )  # fmt: skip
      return loss + jnp.sum(aux.per_token_kl) if mode == "aux" else loss

    return (loss if mode == "fwd" else jax.grad(loss)), args

  return build


# The option sets of tests/kernels/test_lowering.py: sequence-level (GSPO + sequence IS + dual clip: statistics
# and backward kernels), token-level options in the in-kernel coefficient.
SEQUENCE_OPTIONS = dict(
  is_mode="sequence_truncate", importance_sampling_level="sequence", epsilon_c=3.0, is_cap=2.0
)
TOKEN_OPTIONS = dict(is_mode="token_mask", epsilon_c=3.0, temperature=0.7)


def _loss_cases() -> list[CompileCase]:
  out = []
  for name in PRODUCTION_LOSS_SHAPES:
    pre = f"grpo_loss/{name}"
    out += [
      CompileCase(f"{pre}/fwd", "grpo_loss", _loss_case(name, "fwd"), 1),
      CompileCase(f"{pre}/fwd+bwd", "grpo_loss", _loss_case(name, "fwd+bwd"), 1),
      CompileCase(f"{pre}/sequence", "grpo_loss", _loss_case(name, "fwd+bwd", **SEQUENCE_OPTIONS), 2),
      CompileCase(f"{pre}/token-options", "grpo_loss", _loss_case(name, "fwd+bwd", **TOKEN_OPTIONS), 1),
      CompileCase(f"{pre}/aux-grad", "grpo_loss", _loss_case(name, "aux"), 2),
    ]  # fmt: skip
  for mode in ("fwd", "fwd+bwd"):  # issue 48: the support gap in the kernels' own sweeps
    gapped = _loss_case(PRODUCTION_LOSS_SHAPES[0], mode, support_gap=True)
    out.append(CompileCase(f"grpo_loss/{PRODUCTION_LOSS_SHAPES[0]}/{mode}-gapped", "grpo_loss", gapped, 1))  # fmt: skip
  on_policy = _loss_case(PRODUCTION_LOSS_SHAPES[0], "fwd+bwd", on_policy=True, beta=0.0)
  out.append(CompileCase(f"grpo_loss/{PRODUCTION_LOSS_SHAPES[0]}/on-policy", "grpo_loss", on_policy, 1))  # fmt: skip
  # f32 logits at Qwen's V: whole rows outgrow v4's VMEM, where the heuristic tiles the vocabulary
  # (one-sweep statistics, their exact fallback, backward: 3; one training kernel elsewhere); a vocabulary
  # that is not a multiple of 128 (the training kernel's chosen-column gather, issue 52: E2003)
  big = _loss_case("qwen2.5-f32-4k", "fwd+bwd")
  out.append(CompileCase("grpo_loss/qwen2.5-f32-4k/fwd+bwd", "grpo_loss", big, 1, kernels_on=(("v4", 3),)))  # fmt: skip
  out.append(CompileCase("grpo_loss/ragged-32001/fwd+bwd", "grpo_loss", _loss_case("ragged-32001", "fwd+bwd"), 1))  # fmt: skip
  return out


# ---------------------------------------------------------------------------------- fused_linear
def _linear_case(
  shape_name: str, impl: str, grad: bool, gapped: bool = False, **options
) -> Callable:
  """``gapped``: each token scored over its sampled support (a [B, T] ``support_gap``, issue 48)."""
  s = LINEAR_LOSS_SHAPES[shape_name]

  def build(sh):
    b, t, hd, v = s.batch, s.seq, s.hidden, s.vocab
    vocab = None if sh is None else P(None, sh.vocab_axis)
    args = [((b, t, hd), s.dtype, _rows(sh, None, None)), ((hd, v), s.dtype, vocab)]
    args += [((b, t), "int32", _rows(sh, None)), ((b, t), "bool", _rows(sh, None))]
    args += [((b,), "float32", _rows(sh))] + [((b, t), "float32", _rows(sh, None))] * (2 + gapped)

    def loss(h, w, ids, mask, adv, old, sampler, *gap):
      s_ = sampler if options.get("is_mode") else None
      return kernels.fused_linear_grpo_loss(
        h, w, ids, mask, adv, old_logps=old, sampler_logps=s_, support_gap=gap[0] if gap else None,
        impl=impl, sharding=sh, **options,
      )[0]  # fmt: skip

    return (jax.grad(loss, argnums=(0, 1)) if grad else loss), args

  return build


# pallas fwd+bwd: statistics + one gradient kernel per row superblock on single-core generations
# (issue 51): 4 at N = 8192 on v5e / v6e (512 x 1536) and v7x (512 x 512), 1 on the v6e-4 slice
# (4096 rows a device); statistics + dhidden + dweight on megacore ones (v4, v5p)
LINEAR_KERNELS = {("pallas", False): 1, ("pallas", True): 2, ("chunked", False): 1, ("chunked", True): 2}  # fmt: skip
LINEAR_KERNELS_ON = {("pallas", True): (("v4", 3), ("v5e", 5), ("v5p", 3), ("v6e", 5), ("v7x", 5))}
LINEAR_MESH = dict(mesh_axes=(("fsdp", 2), ("tp", 2)), sharding=(("batch_axes", ("fsdp",)), ("vocab_axis", "tp")))  # fmt: skip


def _linear_cases() -> list[CompileCase]:
  """At N = 8192 (as test_lowering.py): the 16k shape runs the same kernels over a longer grid, and
  its chunked XLA program costs twice the compile time (its heuristic kernels compile in the tuner's
  16k problem, :func:`tuner_candidates`)."""
  out = []
  for name in PRODUCTION_LINEAR_LOSS_SHAPES[:1]:
    for impl in ("pallas", "chunked"):
      pre = f"fused_linear/{impl}/{name}"
      for mode, grad, opts in (("fwd", False, {}), ("fwd+bwd", True, {}), ("sequence", True, SEQUENCE_OPTIONS)):  # fmt: skip
        build = _linear_case(name, impl, grad, **opts)
        kernels_on = LINEAR_KERNELS_ON.get((impl, grad), ())
        out.append(CompileCase(f"{pre}/{mode}", "fused_linear", build, LINEAR_KERNELS[impl, grad], kernels_on=kernels_on, **LINEAR_MESH))  # fmt: skip
  # the sampled support (issue 48): the same kernels with each row's threshold as an input
  name = PRODUCTION_LINEAR_LOSS_SHAPES[0]
  for mode, grad in (("fwd", False), ("fwd+bwd", True)):
    build = _linear_case(name, "pallas", grad, gapped=True)
    kernels_on = LINEAR_KERNELS_ON.get(("pallas", grad), ())
    out.append(CompileCase(f"fused_linear/pallas/{name}/{mode}-gapped", "fused_linear", build, LINEAR_KERNELS["pallas", grad], kernels_on=kernels_on, **LINEAR_MESH))  # fmt: skip
  return out


# ------------------------------------------------------------------------------- paged_attention
def _paged_case(shape_name: str) -> Callable:
  s = PAGED_SHAPES[shape_name]

  def build(sh):
    pool = s.batch * s.pages_per_seq
    heads = None if sh is None else sh.head_axis
    kv = ((s.kv_heads, pool, s.page_size, s.head_dim), s.dtype, None if sh is None else P(heads))
    args = [((s.batch, s.q_heads, s.head_dim), s.dtype, _rows(sh, heads)), kv, kv]
    args += [((s.batch,), "int32", _rows(sh)), ((s.batch, s.pages_per_seq), "int32", _rows(sh))]
    fn = lambda *a: kernels.paged_attention(*a, impl="pallas", sharding=sh)
    return fn, args

  return build


PAGED_MESH = dict(mesh_axes=(("dp", 2), ("tp", 2)), sharding=(("batch_axes", ("dp",)), ("head_axis", "tp")))  # fmt: skip


def _paged_cases() -> list[CompileCase]:
  return [
    CompileCase(f"paged_attention/{name}", "paged_attention", _paged_case(name), 1, **PAGED_MESH)
    for name in PRODUCTION_PAGED_SHAPES
  ]


# ------------------------------------------------------------------------------------------ optim
def optim_tree(name: str = "qwen2.5-0.5b") -> dict[str, tuple[int, ...]]:
  """A decoder tree cut to what differs between leaves: the embedding, one layer, the final norm
  (every leaf shape kind of the full tree, 14 of its 290 leaves; the full 0.5B tree takes 25-80 s
  a compile on 2 cores, this one a few)."""
  return {k: v for k, v in decoder_param_shapes(name).items() if not k.startswith("layers.") or k.startswith("layers.0.")}  # fmt: skip


def _optim_case(rule: str) -> Callable:
  def build(sh):
    shapes = optim_tree()
    mesh, specs = None, None
    if (
      sh is not None
    ):  # each leaf's first axis over fsdp where it divides: partition_specs_of's form
      size = sh.mesh.shape[sh.batch_axes[0]]
      specs = {k: P(sh.batch_axes[0]) if s[0] % size == 0 else P() for k, s in shapes.items()}
      mesh = sh.mesh
    make = kernels.optim.fused_adamw_step if rule == "adamw" else kernels.optim.fused_lion_step
    tx, step = make(1e-3, impl="pallas", mesh=mesh, partition_specs=specs)
    keys = list(shapes)
    n_slots = 2 if rule == "adamw" else 1

    def fn(*leaves):  # params, grads, then each state slot, as flat leaves in `keys` order
      cut = [
        dict(zip(keys, leaves[i * len(keys) : (i + 1) * len(keys)])) for i in range(2 + n_slots)
      ]
      state = tx.init(cut[0])
      slots = dict(zip(state.slots, cut[2:]))
      return step(cut[0], cut[1], type(state)(state.count, slots))

    spec = lambda k: None if specs is None else specs[k]
    args = [(shapes[k], "float32", spec(k)) for _ in range(2 + n_slots) for k in keys]
    return fn, args

  return build


OPTIM_MESH = dict(mesh_axes=(("fsdp", 4),), sharding=(("batch_axes", ("fsdp",)),))


def _optim_cases() -> list[CompileCase]:
  # one Mosaic launch for the whole 14-leaf tree (kernels.optim's TPU walk: a launch per leaf would
  # show as 14 here, as it did before that walk)
  return [CompileCase(f"optim/{r}/0.5b-cut", "optim", _optim_case(r), 1, **OPTIM_MESH) for r in ("adamw", "lion")]  # fmt: skip


CASES: tuple[CompileCase, ...] = tuple(_loss_cases() + _linear_cases() + _paged_cases() + _optim_cases())  # fmt: skip


# --------------------------------------------------------------------------------------- compile
@dataclasses.dataclass(frozen=True)
class Result:
  case: str
  where: str  # "v6e" (one chip) or "v6e-4 sharded"
  ok: bool
  seconds: float  # wall
  cpu_seconds: float  # this process's CPU time (every thread): what a dedicated 2-core CI pays
  kernels: int  # Mosaic calls in the compiled HLO (-1: did not compile)
  error: str = ""


def compile_case(case: CompileCase, generation: str, sharded: bool = False) -> Result:
  """Compile ``case`` for one chip of ``generation`` or, ``sharded``, the :data:`SHARDED_SLICE` mesh
  (whose generation is then the slice's). A compile error is a failed Result, never an exception."""
  where = f"{SHARDED_SLICE} sharded" if sharded else generation
  gen = backend.TpuSlice.parse(SHARDED_SLICE).generation.name if sharded else generation

  def build():
    devices = backend.tpu_devices(SHARDED_SLICE if sharded else gen)
    sh = case.kernel_sharding(devices) if sharded else None
    fn, args = case.build(sh)
    place = lambda spec: NamedSharding(sh.mesh, spec or P()) if sh else SingleDeviceSharding(devices[0])  # fmt: skip
    return fn, [jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=place(p)) for s, d, p in args]

  return _compile(case.name, where, gen, build)


def _compile(name: str, where: str, generation: str, build) -> Result:
  """``build() -> (fn, specs)`` traced, lowered and compiled for ``generation``; the Mosaic calls of
  the compiled HLO counted. Wall and CPU seconds of the whole (the CPU time is the CI budget's)."""
  t0, c0 = time.perf_counter(), time.process_time()
  try:
    with backend.use_target("tpu", interpret=False, generation=generation):
      fn, specs = build()
      text = jax.jit(fn).trace(*specs).lower().compile().as_text()
  except Exception as e:  # a compile failure is the result being measured
    return Result(name, where, False, time.perf_counter() - t0, time.process_time() - c0, -1, _first_line(e))  # fmt: skip
  found = text.count(f'custom_call_target="{MARKER}"')
  return Result(name, where, True, time.perf_counter() - t0, time.process_time() - c0, found)


# ---------------------------------------------------------------------------- the tuner's TPU grid
TUNED_OPS = ("grpo_loss", "paged_attention", "fused_linear")  # optim's TPU candidate: the heuristic


def tuner_candidates(generation: str) -> list[tuple[str, object, object]]:
  """(name, candidate, problem) for every kernel candidate ``bench.tune`` offers at the large size on
  ``generation``, after its legality filter (:func:`bench.tune.candidates`): what
  ``impl="auto"`` can pick there once a tune has run. The XLA reference (no kernel) is left out, and
  so are the heuristic's blocks at a shape :data:`CASES` compiles (the same kernels)."""
  from bench import tune

  covered = [dict(dtype=s.dtype, tokens=s.tokens, vocab=s.vocab) for s in map(LOSS_SHAPES.get, PRODUCTION_LOSS_SHAPES)]  # fmt: skip
  covered += [dict(dtype=s.dtype, tokens=s.tokens, hidden=s.hidden, vocab=s.vocab) for s in map(LINEAR_LOSS_SHAPES.get, PRODUCTION_LINEAR_LOSS_SHAPES[:1])]  # fmt: skip
  covered += [_paged_tune_shape(PAGED_SHAPES[n]) for n in PRODUCTION_PAGED_SHAPES]
  # the large-vocabulary loss rows (the compiled report's v4 rows) offer the same blocks as the
  # production ones at other V / dtype: left out to keep nox -s tpu_compile's time (CASES compiles
  # their heuristic's vocab-tiled kernels at qwen2.5-f32-4k)
  skip = [dict(dtype=s.dtype, tokens=s.tokens, vocab=s.vocab) for s in map(LOSS_SHAPES.get, LARGE_VOCAB_LOSS_SHAPES)]  # fmt: skip
  out = []
  with backend.use_target("tpu", interpret=False, generation=generation):
    for op in TUNED_OPS:
      for p in tune.OPS[op][1]("large", "tpu"):
        if op == "grpo_loss" and p.shape in skip:
          continue
        for c in tune.candidates(p, "tpu"):
          if c.impl != "xla" and (c.blocks is not None or p.shape not in covered):
            out.append((f"tune/{op}/{p.op.bucket(p.shape)}/{c.label}", c, p))
  return out


def _paged_tune_shape(s) -> dict:
  keys = ("batch", "q_heads", "kv_heads", "head_dim", "page_size", "ctx")
  return dict(dtype=s.dtype, **{k: getattr(s, k) for k in keys})


def compile_candidate(name: str, cand, problem, generation: str) -> Result:
  """Compile a tuner candidate's own function (what the tuner times) on one chip of ``generation``."""

  def build():
    dev = SingleDeviceSharding(backend.tpu_devices(generation)[0])
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev)
    return cand.fn, jax.tree.map(place, jax.eval_shape(problem.make_inputs))

  return _compile(name, generation, generation, build)


def _first_line(e: Exception) -> str:
  msg = f"{type(e).__name__}: {e}"
  lines = [ln for ln in msg.splitlines() if ln.strip()]
  keep = [
    ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "Mosaic" in ln or "error" in ln.lower()
  ]
  return (keep or lines or [msg])[0][:300]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--gen", action="append", choices=GENERATIONS, help="default: all")
  ap.add_argument("--case", action="append", default=[], help="substring of the case names")
  ap.add_argument("--no-sharded", action="store_true")
  ap.add_argument("--tuner", action="store_true", help="also the tuner's TPU candidates")
  args = ap.parse_args(argv)
  pick = lambda name: not args.case or any(s in name for s in args.case)
  cases = [c for c in CASES if pick(c.name)]
  gens = args.gen or GENERATIONS
  runs = [(c, lambda c=c, g=g: compile_case(c, g)) for g in gens for c in cases]
  runs += [] if args.no_sharded else [(c, lambda c=c: compile_case(c, None, True)) for c in cases]
  for g in gens if args.tuner else ():
    runs += [(None, lambda n=n, c=c, p=p, g=g: compile_candidate(n, c, p, g)) for n, c, p in tuner_candidates(g) if pick(n)]  # fmt: skip
  failed = 0
  for case, run in runs:
    r = run()
    bad = not r.ok or r.kernels < 1 or (case is not None and r.kernels != case.kernels_for(r.where))
    failed += bad
    status = "ok " if not bad else ("BAD" if r.ok else "ERR")
    print(f"{status} {r.where:16s} {r.case:52s} {r.seconds:6.1f}s wall {r.cpu_seconds:6.1f}s cpu kernels={r.kernels} {r.error}", flush=True)  # fmt: skip
  print(f"{len(runs) - failed} of {len(runs)} compiled with the expected kernels")
  return 1 if failed else 0


if __name__ == "__main__":
  raise SystemExit(main())
