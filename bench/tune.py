"""``python -m bench.tune``: run the autotuner (:mod:`kernels.autotune`) on this device's bench shapes.

Problems are the bench's own cases (grpo_loss fwd+bwd, paged_attention), so the tuner checks parity
with exactly the inputs, references and tolerances the bench uses. Candidates per op: the XLA
reference, the Triton kernel (``pallas``) and the Mosaic GPU kernel (``mosaic_gpu``) over a small grid
of legal block configurations (on TPU: xla and the Mosaic TPU kernel). On CPU everything runs in the
interpreters: that exercises the plumbing (``--size tiny``), it is not a performance figure.

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
from bench.cases import grpo_loss as loss_cases
from bench.cases import paged_attention as paged_cases
from bench.shapes import LOSS_SHAPES, PAGED_SHAPES
from kernels import autotune, backend
from kernels.grpo_loss import LossBlocks
from kernels.grpo_loss import blocks as loss_blocks
from kernels.grpo_loss.mosaic_gpu import MosaicLossBlocks
from kernels.paged_attention import PagedBlocks
from kernels.paged_attention.mosaic_gpu import MosaicPagedBlocks


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
      )
    )
  return out


def loss_candidates(problem: autotune.Problem, platform: str) -> list[autotune.Candidate]:
  """XLA, the Pallas kernel family of the platform and (GPU / CPU) Mosaic GPU, over the blocks that
  trade bytes in flight against rows swept at once (kernels/grpo_loss/blocks.py's launch budgets):
  Triton chunk width x warps x pipeline stages, skipping configurations the register model says
  cannot hold one program per SM; TPU rows per training step; Mosaic GPU tile width x ring depth."""
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
    pallas = [None] + [LossBlocks(bn, 2048) for bn in (8, 32) if bn < tokens]
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
      )
    )
  return out


def paged_candidates(problem: autotune.Problem, platform: str) -> list[autotune.Candidate]:
  s = problem.shape
  fn = lambda impl, blocks: functools.partial(_paged, impl, platform, blocks)
  cands = [autotune.Candidate("xla", None, fn("xla", None))]
  pages = s["ctx"] // s["page_size"]
  if platform == "gpu":
    for tokens, splits in itertools.product((64, 128, 256), (1, 2, 4, 8)):
      ppb = max(1, tokens // s["page_size"])
      if ppb * splits > pages:
        continue
      blocks = PagedBlocks(ppb, splits)
      cands.append(autotune.Candidate("pallas", blocks, fn("pallas", blocks)))
  else:
    cands.append(autotune.Candidate("pallas", None, fn("pallas", None)))
  mosaic_ok = jnp.dtype(s["dtype"]).name in ("bfloat16", "float16") and s["head_dim"] % 64 == 0
  if platform in ("gpu", "cpu") and mosaic_ok and s["page_size"] % 8 == 0:
    grid = list(itertools.product((64, 128), (1, 2, 4, 8), (2, 3)))
    if platform == "cpu":
      grid = [(64, 1, 2)]
    for tokens, splits, stages in grid:
      ppb = max(1, tokens // s["page_size"])
      blocks = MosaicPagedBlocks(ppb, splits, stages)
      try:
        blocks.check(s["page_size"], s["head_dim"], s["dtype"])
      except ValueError:
        continue
      if ppb * splits <= pages:
        cands.append(autotune.Candidate("mosaic_gpu", blocks, fn("mosaic_gpu", blocks)))
  return cands


# -------------------------------------------------------------------------------------------- main
def run(size: str, out: Path | None = None, ops=autotune.OPS, repeats: int = 5, log=print) -> Path:
  """Tune ``ops`` at the bench's ``size`` on this host; returns the cache file written."""
  platform = backend.host_platform()
  problems, makers = [], {}
  if "grpo_loss" in ops:
    problems += loss_problems(size, platform)
    makers["grpo_loss"] = loss_candidates
  if "paged_attention" in ops:
    problems += paged_problems(size, platform)
    makers["paged_attention"] = paged_candidates
  return autotune.tune(
    problems,
    lambda p: makers[p.op](p, platform),
    directory=out,
    repeats=repeats,
    log=log,
  )


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--size", default="large", choices=("tiny", "small", "large"))
  ap.add_argument("--op", action="append", choices=autotune.OPS, help="default: every op")
  ap.add_argument("--out", type=Path, help=f"cache directory (default {autotune.TUNING_DIR})")
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  path = run(args.size, args.out, tuple(args.op or autotune.OPS), args.repeats)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
