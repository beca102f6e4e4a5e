"""``python -m bench.tune``: run the autotuner (:mod:`kernels.autotune`) on this device's bench shapes.

Problems are the bench's own cases (grpo_loss fwd+bwd, paged_attention, the optimizers' in-place step,
the fused LM-head loss fwd+bwd), so the tuner checks parity with exactly the inputs, references and
tolerances the bench uses. Per problem the op as it runs today (``impl="auto"``, default blocks) is
timed first, then the candidates: the XLA reference, the Triton kernel (``pallas``), the Mosaic GPU
kernel (``mosaic_gpu``) over a small grid of legal blocks (on TPU: xla and the Mosaic TPU kernel);
optim: the Pallas pass over element-wise blocks; fused_linear: ``chunked`` over chunk sizes, the
fused ``pallas`` kernels off GPU, and on GPU ``mosaic_gpu`` over ``candidate_blocks`` (tiles, vocab
chunks and stored columns within the 5 % temp target); ``impl="auto"`` then reads the winner. Each op stops trying candidates when its ``--budget-s`` is spent; a
line per candidate is printed as it is timed, and the cache is rewritten after every problem. On CPU
everything runs in the interpreters: that exercises the plumbing (``--size tiny``), not performance.

    python -m bench.tune --size large              # writes kernels/tuning/<device-kind>.json
    python -m bench.tune --size tiny --out /tmp/t   # dry run of the plumbing on any host
"""

from __future__ import annotations

import argparse
import functools
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp

import kernels
from bench.cases import fused_linear as linear_cases
from bench.cases import grpo_loss as loss_cases
from bench.cases import optim as optim_cases
from bench.cases import paged_attention as paged_cases
from bench.shapes import LINEAR_LOSS_SHAPES, LOSS_SHAPES, PAGED_SHAPES
from kernels import autotune, backend, optim
from kernels.fused_linear import LinearBlocks
from kernels.fused_linear import mosaic_gpu_blocks as linear_mosaic
from kernels.fused_linear import pallas_blocks as linear_blocks
from kernels.grpo_loss import LossBlocks
from kernels.grpo_loss import pallas_blocks as loss_blocks
from kernels.grpo_loss.mosaic_gpu_blocks import ClusterLossBlocks, MosaicLossBlocks
from kernels.paged_attention import PagedBlocks
from kernels.paged_attention import pallas_blocks as paged_blocks
from kernels.paged_attention.mosaic_gpu_blocks import MosaicPagedBlocks


# --------------------------------------------------------------------------------------- grpo_loss
def _loss_fwd_bwd(impl, platform, blocks, logits, ids, mask, adv):
  f = lambda x: kernels.grpo_loss(x, ids, mask, adv, impl=impl, platform=platform, blocks=blocks)[0]
  return jax.value_and_grad(f)(logits)


def loss_problems(size: str, platform: str) -> list[autotune.Problem]:
  out = []
  for case in loss_cases.cases(size, platform):
    if case.mode != "fwd+bwd":
      continue
    s = LOSS_SHAPES[case.shape_name]
    shape = dict(dtype=jnp.dtype(s.dtype).name, tokens=s.tokens, vocab=s.vocab)
    out.append(
      autotune.Problem(
        "grpo_loss",
        shape,
        functools.partial(case.make_inputs, 0),
        functools.partial(_loss_fwd_bwd, "xla", platform, None),
        case.checks,
        functools.partial(_loss_fwd_bwd, "auto", platform, None),
        ideal_bytes=case.bytes,
      )
    )
  return out


def loss_candidates(problem: autotune.Problem, platform: str) -> list[autotune.Candidate]:
  """XLA, the Pallas kernel family of the platform and (GPU / CPU) Mosaic GPU, over the blocks that
  trade bytes in flight against rows swept at once (kernels/grpo_loss/pallas_blocks.py's launch budgets):
  Triton chunk width x warps x pipeline stages, skipping configurations the register model says
  cannot hold one program per SM; TPU rows per training step; Mosaic GPU tile width x ring depth,
  and on GPU the cluster-split kernels' rows x cluster size (those whose slices fit shared memory).
  Those are offered only once kernels/autotune.py reads ClusterLossBlocks back for mosaic_gpu."""
  dtype = problem.shape["dtype"]
  itemsize = jnp.dtype(dtype).itemsize
  tokens, vocab = problem.shape["tokens"], problem.shape["vocab"]
  fn = lambda impl, blocks: functools.partial(_loss_fwd_bwd, impl, platform, blocks)
  cands = [autotune.Candidate("xla", None, fn("xla", None))]
  pallas = [None]
  if platform == "gpu":
    pallas = []
    for bv, warps, stages in itertools.product((4096, 8192, 16384), (8, 16, 32), (1, 2)):
      blocks = LossBlocks(1, bv, num_warps=warps, num_stages=stages)
      if loss_blocks.rowloop_budget(tokens, vocab, itemsize, blocks).resident_per_sm >= 1:
        pallas.append(blocks)
  elif platform == "tpu":
    # rows per step (the row blocks' VMEM) x columns per unrolled sweep iteration (schedule slots)
    pallas = [None] + [LossBlocks(bn, bv) for bn, bv in ((16, 2048), (32, 8192), (64, 4096))
                       if bn < tokens]  # fmt: skip
  cands += [autotune.Candidate("pallas", b, fn("pallas", b)) for b in pallas]
  if platform in ("gpu", "cpu"):
    unit = 128 // itemsize  # swizzle width in elements
    grid = ((unit, 3), (unit, 4), (2 * unit, 2), (2 * unit, 4), (4 * unit, 2))
    if platform == "cpu":
      grid = grid[2:3]  # the interpreter is slow: one config exercises the plumbing
    for bv, stages in grid:
      blocks = MosaicLossBlocks(64, bv, stages)
      try:
        blocks.check(dtype)
      except ValueError:
        continue
      cands.append(autotune.Candidate("mosaic_gpu", blocks, fn("mosaic_gpu", blocks)))
  if platform == "gpu":  # the cluster-split kernels: rows x CTAs per cluster (the row read once)
    chunk = 2 * 128 * 16 // itemsize
    for rows, cluster in itertools.product((1, 2, 4), (4, 8)):
      blocks = ClusterLossBlocks(rows, cluster, chunk)
      try:
        blocks.check(dtype, vocab)
      except ValueError:
        continue
      cands.append(autotune.Candidate("mosaic_gpu", blocks, fn("mosaic_gpu", blocks)))
  return cands


# --------------------------------------------------------------------------------- paged_attention
def _paged(impl, platform, blocks, q, k_pages, v_pages, lengths, page_indices):
  return kernels.paged_attention(
    q, k_pages, v_pages, lengths, page_indices, impl=impl, platform=platform, blocks=blocks
  )


def paged_problems(size: str, platform: str) -> list[autotune.Problem]:
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
      autotune.Problem(
        "paged_attention",
        shape,
        functools.partial(case.make_inputs, 0),
        functools.partial(_paged, "xla", platform, None),
        case.checks,
        functools.partial(_paged, "auto", platform, None),
        ideal_bytes=case.bytes,
      )
    )
  return out


def paged_candidates(problem: autotune.Problem, platform: str) -> list[autotune.Candidate]:
  """xla, then Triton over tile tokens x pipeline stages x splits x warps, and Mosaic GPU over tile
  tokens x ring stages x splits. Splits: 1, the wave heuristic's (:func:`plan.wave_splits`), and its
  double; a tile must leave at least one block per split. On CPU (the interpreters) the
  heuristic blocks only, plus one Mosaic GPU config: the plumbing, not a timing."""
  from kernels.paged_attention import plan

  s = problem.shape
  fn = lambda impl, blocks: functools.partial(_paged, impl, platform, blocks)
  cands = [autotune.Candidate("xla", None, fn("xla", None))]
  ps, pages = s["page_size"], -(-s["ctx"] // s["page_size"])
  work = s["batch"] * s["kv_heads"]

  def splits_for(tokens: int) -> list[int]:
    blocks_total = -(-pages // max(1, tokens // ps))
    wave = plan.wave_splits(work, blocks_total)
    return sorted({n for n in (1, wave, 2 * wave) if n <= blocks_total})

  if platform == "gpu":
    for tokens, stages, warps in itertools.product((32, 64, 128), (2, 3, 4, 6), (4, 8)):
      if max(1, tokens // ps) * ps < 16 or (tokens >= 128 and stages > 4):  # Triton dot; smem
        continue
      for splits in splits_for(tokens):
        blocks = PagedBlocks(max(1, tokens // ps), splits, num_stages=stages, num_warps=warps)
        cands.append(autotune.Candidate("pallas", blocks, fn("pallas", blocks)))
  else:
    cands.append(autotune.Candidate("pallas", None, fn("pallas", None)))
  mosaic_ok = jnp.dtype(s["dtype"]).name in ("bfloat16", "float16") and s["head_dim"] % 64 == 0
  if platform in ("gpu", "cpu") and mosaic_ok and ps % 8 == 0:
    grid = [(t, st) for t in (64, 128) for st in (2, 3, 4, 5)]
    if platform == "cpu":
      grid = [(64, 2)]
    for tokens, stages in grid:
      for splits in splits_for(tokens) if platform == "gpu" else [1]:
        blocks = MosaicPagedBlocks(max(1, tokens // ps), splits, stages)
        try:
          blocks.check(ps, s["head_dim"], s["dtype"], pages)
        except ValueError:  # tile not a multiple of 64 tokens, or over the shared-memory budget
          continue
        cands.append(autotune.Candidate("mosaic_gpu", blocks, fn("mosaic_gpu", blocks)))
  return cands


# ------------------------------------------------------------------------------------------- optim
def _optim_step(which, impl, platform, blocks, params, grads, state):
  _, step = optim_cases.FUSED_STEP[which](
    **optim_cases.HYPER[which], impl=impl, platform=platform, blocks=blocks
  )
  return step(params, grads, optim_cases._convert_state(which, state))


def optim_problems(size: str, platform: str) -> list[autotune.Problem]:
  """One problem per rule and parameter tree: the in-place step against optax (the bench's case)."""
  out = []
  for case in optim_cases.cases(size, platform):
    if not case.op.endswith("-inplace"):
      continue
    which = case.op.split("/")[1].split("-")[0]
    shape = dict(rule=which, dtype="float32", params=case.params["params"])
    step = lambda impl, which=which: functools.partial(_optim_step, which, impl, platform, None)
    out.append(
      autotune.Problem(
        "optim",
        shape,
        functools.partial(case.make_inputs, 0),
        case.reference,
        case.checks,
        step("auto"),
        ideal_bytes=case.bytes,
      )
    )
  return out


def optim_candidates(problem: autotune.Problem, platform: str) -> list[autotune.Candidate]:
  which = problem.shape["rule"]
  fn = lambda impl, blocks: functools.partial(_optim_step, which, impl, platform, blocks)
  cands = [autotune.Candidate("xla", None, fn("xla", None))]
  if (
    platform == "gpu"
  ):  # the multi-tensor launch's grid (kernels.optim.pallas_triton), heuristic first
    for blocks in optim.candidate_blocks(*optim_cases.ARRAYS[which]):
      cands.append(autotune.Candidate("pallas", blocks, fn("pallas", blocks)))
  else:  # TPU Mosaic / CPU interpreter: the heuristic blocks only
    cands.append(autotune.Candidate("pallas", None, fn("pallas", None)))
  return cands


# ------------------------------------------------------------------------------------ fused_linear
def _linear(impl, platform, blocks, hidden, lm_head, ids, mask, adv):
  extra = {}
  if isinstance(blocks, autotune.ChunkBlocks):
    extra["chunk_size"] = blocks.chunk_size
  elif blocks is not None:
    extra["blocks"] = blocks
  f = lambda h, w: kernels.fused_linear_grpo_loss(
    h, w, ids, mask, adv, impl=impl, platform=platform, **extra
  )[0]
  return jax.value_and_grad(f, argnums=(0, 1))(hidden, lm_head)


def linear_problems(size: str, platform: str) -> list[autotune.Problem]:
  out = []
  for case in linear_cases.cases(size, platform):
    if case.mode != "fwd+bwd" or case.op != "fused_linear/chunked":
      continue  # one problem per shape (the cases repeat the shape per impl)
    s = LINEAR_LOSS_SHAPES[case.shape_name]
    shape = dict(dtype=jnp.dtype(s.dtype).name, tokens=s.tokens, hidden=s.hidden, vocab=s.vocab)
    out.append(
      autotune.Problem(
        "fused_linear",
        shape,
        functools.partial(case.make_inputs, 0),
        functools.partial(_linear, "xla", platform, None),
        case.checks,
        functools.partial(_linear, "auto", platform, None),
        ideal_bytes=case.bytes,
      )
    )
  return out


def linear_candidates(problem: autotune.Problem, platform: str) -> list[autotune.Candidate]:
  s = problem.shape
  fn = lambda impl, blocks: functools.partial(_linear, impl, platform, blocks)
  cands = [autotune.Candidate("xla", None, fn("xla", None))]
  n_pow2 = 1 << max(s["tokens"] - 1, 0).bit_length()
  chunks = (512, 1024, 2048, 4096) if platform == "gpu" else (min(n_pow2, 128),)
  for chunk in chunks:
    if chunk <= n_pow2 and chunk * s["vocab"] * 4 <= 4 << 30:  # f32 [chunk, V] logits <= 4 GiB
      blocks = autotune.ChunkBlocks(chunk)
      cands.append(autotune.Candidate("chunked", blocks, fn("chunked", blocks)))
  if platform != "gpu":  # the fully fused kernels need grid-axis accumulation (TPU / interpreter)
    cands.append(autotune.Candidate("pallas", None, fn("pallas", None)))
  if platform == "gpu":  # the Mosaic GPU fused kernels (what "pallas" means there for bf16 / f16)
    for blocks in linear_mosaic.candidate_blocks(s, platform):
      cands.append(autotune.Candidate("mosaic_gpu", blocks, fn("mosaic_gpu", blocks)))
  return cands


# -------------------------------------------------------------------------------------------- main
LEGAL_ON = {  # per kernel family: why blocks cannot compile on a target (a TPU generation's VMEM, tiles)
  "grpo_loss": (LossBlocks, loss_blocks.legal_on),
  "paged_attention": (PagedBlocks, paged_blocks.legal_on),
  "fused_linear": (LinearBlocks, linear_blocks.legal_on),
}


def legal_candidates(problem: autotune.Problem, cands, platform: str) -> list[autotune.Candidate]:
  """``cands`` less those whose TPU blocks cannot compile on this device's generation, so that
  ``impl="auto"`` can never pick one (GPU / CPU candidates are checked by their own grids)."""
  kind, legal_on = LEGAL_ON.get(problem.op, (None, None))
  if platform != "tpu" or legal_on is None:
    return list(cands)
  target = backend.resolve(platform)
  ok = lambda b: not isinstance(b, kind) or legal_on(target, b, problem.shape) is None
  return [c for c in cands if ok(c.blocks)]


PROBLEMS = {
  "grpo_loss": (loss_problems, loss_candidates),
  "paged_attention": (paged_problems, paged_candidates),
  "optim": (optim_problems, optim_candidates),
  "fused_linear": (linear_problems, linear_candidates),
}


def run(
  size: str,
  out: Path | None = None,
  ops=autotune.OPS,
  repeats: int = 5,
  log=print,
  budget_s: float | None = None,
  **search,
) -> Path:
  """Tune ``ops`` at the bench's ``size`` on this host, one op after the other (each within
  ``budget_s`` seconds of candidates); returns the cache file, rewritten after every problem.
  ``search``: :func:`kernels.autotune.tune`'s platform / kind / evaluate / source, for the modelled
  search of ``--target`` (bench.compiled.tune_in_process)."""
  unknown = sorted(set(ops) - set(PROBLEMS))
  if unknown:
    raise ValueError(f"ops must be among {tuple(PROBLEMS)}, got {unknown}")
  platform = search.pop("platform", None) or backend.host_platform()
  path = None
  for op in ops:
    problems_of, candidates_of = PROBLEMS[op]
    path = autotune.tune(
      problems_of(size, platform),
      lambda p, c=candidates_of: legal_candidates(p, c(p, platform), platform),
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
  ap.add_argument("--op", action="append", choices=autotune.OPS, help="default: every op")
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
    from bench import compiled

    if args.in_process:
      ops = tuple(dict.fromkeys(args.op or autotune.OPS))
      path = compiled.tune_in_process(args.target, args.size, args.out, ops, run_modelled_op=run)
    else:
      path = compiled.tune_modelled(args.target, args.size, args.out, args.op or autotune.OPS)
    print(f"wrote {path}")
    return
  if args.repeats < 1 or (args.budget_s is not None and args.budget_s <= 0):
    ap.error("--repeats must be >= 1 and --budget-s > 0")
  log = lambda line: print(line, flush=True)  # a killed tune's log shows where it was
  ops = tuple(dict.fromkeys(args.op or autotune.OPS))
  path = run(args.size, args.out, ops, args.repeats, log, args.budget_s)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
