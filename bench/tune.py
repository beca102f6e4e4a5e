"""``python -m bench.tune``: run the autotuner (its search: :mod:`bench.kernels.autotune_search`; its cache:
:mod:`kernels.autotune`) on this device's bench shapes.

Problems are the bench's own cases (grpo_loss fwd+bwd, paged_attention, the optimizers' in-place step,
the fused LM-head loss fwd+bwd), so the tuner checks parity with exactly the inputs, references and
tolerances the bench uses. Per problem the op as it runs today (``impl="auto"``, default blocks) is
timed first, then the candidates its table offers on this platform (:meth:`kernels.ops.Op.candidates`:
the XLA reference, then each impl's grid: the Triton kernel (``pallas``) and the Mosaic GPU kernel
(``mosaic_gpu``) over small grids of legal blocks on GPU, the Mosaic TPU kernel on TPU; optim: the
multi-tensor launch's grid; fused_linear: ``chunked`` over chunk sizes, the fused ``pallas`` kernels
off GPU, and on GPU ``mosaic_gpu`` over its tiles, vocab chunks and stored columns within the 5 % temp
target); ``impl="auto"`` then reads the winner. Each op stops trying candidates when its
``--budget-s`` is spent; a line per candidate is printed as it is timed, and the cache is rewritten
after every problem. On CPU everything runs in the interpreters: that exercises the plumbing
(``--size tiny``), not performance.

    python -m bench.tune --size large              # writes kernels/tuning/<device-kind>.json
    python -m bench.tune --size tiny --out /tmp/t   # dry run of the plumbing on any host
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

import kernels
from bench.kernels.autotune_search import Candidate, Problem, tune
from bench.kernels.cases import fused_linear as linear_cases
from bench.kernels.cases import grpo_loss as loss_cases
from bench.kernels.cases import optim as optim_cases
from bench.kernels.cases import paged_attention as paged_cases
from bench.shapes import LINEAR_LOSS_SHAPES, LOSS_SHAPES, PAGED_SHAPES
from kernels import autotune, backend
from kernels.fused_linear import OP as LINEAR_OP
from kernels.fused_linear import ChunkBlocks
from kernels.grpo_loss import OP as LOSS_OP
from kernels.optim import OP as OPTIM_OP
from kernels.paged_attention import OP as PAGED_OP


# --------------------------------------------------------------------------------------- grpo_loss
def _loss_fwd_bwd(impl, platform, blocks, logits, ids, mask, adv):
  f = lambda x: kernels.grpo_loss(x, ids, mask, adv, impl=impl, platform=platform, blocks=blocks)[0]
  return jax.value_and_grad(f)(logits)


def loss_problems(size: str, platform: str) -> list[Problem]:
  out = []
  for case in loss_cases.cases(size, platform):
    if case.mode != "fwd+bwd":
      continue
    s = LOSS_SHAPES[case.shape_name]
    shape = dict(dtype=jnp.dtype(s.dtype).name, tokens=s.tokens, vocab=s.vocab)
    out.append(
      Problem(
        LOSS_OP,
        shape,
        functools.partial(case.make_inputs, 0),
        functools.partial(_loss_fwd_bwd, "xla", platform, None),
        case.checks,
        functools.partial(_loss_fwd_bwd, "auto", platform, None),
        ideal_bytes=case.bytes,
      )
    )
  return out


# --------------------------------------------------------------------------------- paged_attention
def _paged(impl, platform, blocks, q, k_pages, v_pages, lengths, page_indices):
  return kernels.paged_attention(
    q, k_pages, v_pages, lengths, page_indices, impl=impl, platform=platform, blocks=blocks
  )


def paged_problems(size: str, platform: str) -> list[Problem]:
  out = []
  for case in paged_cases.cases(size, platform):
    if not case.op.endswith("/pallas"):
      continue
    s = PAGED_SHAPES[case.shape_name]
    shape = dict(
      dtype=jnp.dtype(s.dtype).name,
      batch=s.batch,
      q_heads=s.q_heads,
      kv_heads=s.kv_heads,
      head_dim=s.head_dim,
      page_size=s.page_size,
      ctx=s.ctx,
    )
    out.append(
      Problem(
        PAGED_OP,
        shape,
        functools.partial(case.make_inputs, 0),
        functools.partial(_paged, "xla", platform, None),
        case.checks,
        functools.partial(_paged, "auto", platform, None),
        ideal_bytes=case.bytes,
      )
    )
  return out


# ------------------------------------------------------------------------------------------- optim
def _optim_step(which, impl, platform, blocks, params, grads, state):
  _, step = optim_cases.FUSED_STEP[which](
    **optim_cases.HYPER[which], impl=impl, platform=platform, blocks=blocks
  )
  return step(params, grads, optim_cases._convert_state(which, state))


def optim_problems(size: str, platform: str) -> list[Problem]:
  """One problem per rule and parameter tree: the in-place step against optax (the bench's case)."""
  out = []
  for case in optim_cases.cases(size, platform):
    if not case.op.endswith("-inplace"):
      continue
    which = case.op.split("/")[1].split("-")[0]
    shape = dict(rule=which, dtype="float32", params=case.params["params"])
    step = lambda impl, which=which: functools.partial(_optim_step, which, impl, platform, None)
    out.append(
      Problem(
        OPTIM_OP,
        shape,
        functools.partial(case.make_inputs, 0),
        case.reference,
        case.checks,
        step("auto"),
        ideal_bytes=case.bytes,
      )
    )
  return out


# ------------------------------------------------------------------------------------ fused_linear
def _linear(impl, platform, blocks, hidden, lm_head, ids, mask, adv):
  extra = {}
  if isinstance(blocks, ChunkBlocks):
    extra["chunk_size"] = blocks.chunk_size
  elif blocks is not None:
    extra["blocks"] = blocks
  f = lambda h, w: kernels.fused_linear_grpo_loss(
    h, w, ids, mask, adv, impl=impl, platform=platform, **extra
  )[0]
  return jax.value_and_grad(f, argnums=(0, 1))(hidden, lm_head)


def linear_problems(size: str, platform: str) -> list[Problem]:
  out = []
  for case in linear_cases.cases(size, platform):
    if case.mode != "fwd+bwd" or case.op != "fused_linear/chunked":
      continue  # one problem per shape (the cases repeat the shape per impl)
    s = LINEAR_LOSS_SHAPES[case.shape_name]
    shape = dict(dtype=jnp.dtype(s.dtype).name, tokens=s.tokens, hidden=s.hidden, vocab=s.vocab)
    out.append(
      Problem(
        LINEAR_OP,
        shape,
        functools.partial(case.make_inputs, 0),
        functools.partial(_linear, "xla", platform, None),
        case.checks,
        functools.partial(_linear, "auto", platform, None),
        ideal_bytes=case.bytes,
      )
    )
  return out


# -------------------------------------------------------------------------------------------- main
# The ops the tuner knows: each one's table, its bench problems, and the call of the op a candidate
# times at a shape: call(shape)(impl, platform, blocks, *inputs).
OPS = {
  "grpo_loss": (LOSS_OP, loss_problems, lambda shape: _loss_fwd_bwd),
  "paged_attention": (PAGED_OP, paged_problems, lambda shape: _paged),
  "optim": (OPTIM_OP, optim_problems, lambda shape: functools.partial(_optim_step, shape["rule"])),
  "fused_linear": (LINEAR_OP, linear_problems, lambda shape: _linear),
}


def candidates(problem: Problem, platform: str) -> list[Candidate]:
  """The op table's candidates at the problem's shape (:meth:`kernels.ops.Op.candidates`: the
  reference, then each impl's grid on this platform), less those whose blocks cannot compile on
  this TPU generation (the impl's ``supported_on``: a generation's VMEM, tiles), so that
  ``impl="auto"`` can never pick one (GPU / CPU candidates are checked by their own grids)."""
  op, _, call = OPS[problem.op.name]
  target = backend.resolve(platform) if platform == "tpu" else None
  out = []
  for impl, blocks in op.candidates(problem.shape, platform):
    legal = target is None or blocks is None
    if not legal and op[impl].supported_on(target, problem.shape, blocks) is not None:
      continue
    fn = functools.partial(call(problem.shape), impl, platform, blocks)
    out.append(Candidate(impl, blocks, fn))
  return out


def run(
  size: str,
  out: Path | None = None,
  ops=tuple(OPS),
  repeats: int = 5,
  log=print,
  budget_s: float | None = None,
  **search,
) -> Path:
  """Tune ``ops`` at the bench's ``size`` on this host, one op after the other (each within
  ``budget_s`` seconds of candidates); returns the cache file, rewritten after every problem.
  ``search``: :func:`bench.kernels.autotune_search.tune`'s platform / kind / evaluate / source, for the
  modelled search of ``--target`` (bench.tpu.compiled.tune_in_process)."""
  unknown = sorted(set(ops) - set(OPS))
  if unknown:
    raise ValueError(f"ops must be among {tuple(OPS)}, got {unknown}")
  platform = search.pop("platform", None) or backend.host_platform()
  path = None
  for op in ops:
    path = tune(
      OPS[op][1](size, platform),
      lambda p: candidates(p, platform),
      directory=out,
      repeats=repeats,
      log=log,
      budget_s=budget_s,
      **search,
    )
  return path


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--size", default="large", choices=("tiny", "small", "large"))
  ap.add_argument("--op", action="append", choices=tuple(OPS), help="default: every op")
  ap.add_argument("--out", type=Path, help=f"cache directory (default {autotune.TUNING_DIR})")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--budget-s", type=float, help="seconds of candidates per op (default: no limit)")
  ap.add_argument(
    "--target",
    help="a TPU generation / slice (tpu-v6e, v5e) to tune for without one: each candidate compiled "
    "for it, those that do not compile dropped with the compiler's reason, the rest ranked by "
    "modelled time; the cache (its device kind's) marked modelled. A measured entry always wins.",
  )
  ap.add_argument(
    "--in-process", action="store_true", help=argparse.SUPPRESS
  )  # the op's subprocess
  args = ap.parse_args(argv)
  if args.target:
    from bench.tpu import compiled

    if args.in_process:
      ops = tuple(dict.fromkeys(args.op or tuple(OPS)))
      path = compiled.tune_in_process(args.target, args.size, args.out, ops, run_modelled_op=run)
    else:
      path = compiled.tune_modelled(args.target, args.size, args.out, args.op or tuple(OPS))
    print(f"wrote {path}")
    return
  if args.repeats < 1 or (args.budget_s is not None and args.budget_s <= 0):
    ap.error("--repeats must be >= 1 and --budget-s > 0")
  log = lambda line: print(line, flush=True)  # a killed tune's log shows where it was
  ops = tuple(dict.fromkeys(args.op or tuple(OPS)))
  path = run(args.size, args.out, ops, args.repeats, log, args.budget_s)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
