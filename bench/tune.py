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
  dtype = problem.shape["dtype"]
  fn = lambda impl, blocks: functools.partial(_loss_fwd_bwd, impl, platform, blocks)
  cands = [autotune.Candidate("xla", None, fn("xla", None))]
  if platform == "gpu":
    for bv, warps in itertools.product((2048, 4096, 8192), (4, 8, 16)):
      blocks = LossBlocks(1, bv, num_warps=warps)
      cands.append(autotune.Candidate("pallas", blocks, fn("pallas", blocks)))
  else:  # TPU Mosaic / CPU interpreter: the heuristic blocks only
    cands.append(autotune.Candidate("pallas", None, fn("pallas", None)))
  if platform in ("gpu", "cpu"):
    unit = 128 // jnp.dtype(dtype).itemsize  # swizzle width in elements
    grid = ((unit, 3), (2 * unit, 2), (2 * unit, 4), (4 * unit, 2))
    if platform == "cpu":
      grid = grid[1:2]  # the interpreter is slow: one config exercises the plumbing
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
