"""Mosaic GPU rows (impl="mosaic_gpu") beside the Triton ones: the grpo_loss and paged_attention cases
with the kernel swapped, same inputs, reference, bytes and parity checks, so the two GPU lowerings are
compared row by row in one report, plus ``grpo_loss/mosaic_gpu_cluster`` rows (the cluster-split
kernels, GPU only). On a GPU at every size; on CPU only at ``tiny`` (the Mosaic GPU interpreter is a
correctness tool: its timings say nothing); never on TPU."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from bench.kernels.cases import Case
from bench.kernels.cases import grpo_loss as loss_cases
from bench.kernels.cases import paged_attention as paged_cases
from kernels.grpo_loss.mosaic_gpu_blocks import default_cluster_blocks as cluster_blocks
from kernels.paged_attention.mosaic_gpu_blocks import DTYPES as PAGED_DTYPES


def cases(size: str, platform: str) -> list[Case]:
  if platform == "tpu" or (platform == "cpu" and size != "tiny"):
    return []
  out = []
  for case in loss_cases.cases(size, platform):
    run = loss_cases._fwd if case.mode == "fwd" else loss_cases._fwd_bwd
    kernel = functools.partial(run, "mosaic_gpu", platform)
    out.append(dataclasses.replace(case, op="grpo_loss/mosaic_gpu", kernel=kernel))
    if platform == "gpu":  # the cluster-split kernels (default ClusterLossBlocks), GPU only
      p = case.params
      blocks = cluster_blocks(jnp.dtype(p["dtype"]), p["vocab"])
      kernel = functools.partial(run, "mosaic_gpu", platform, blocks=blocks)
      params = {**p, "blocks": str(blocks)}
      out.append(
        dataclasses.replace(case, op="grpo_loss/mosaic_gpu_cluster", kernel=kernel, params=params)
      )
  for case in paged_cases.cases(size, platform):
    if not case.op.endswith("/pallas") or case.params["head_dim"] % 64:
      continue
    if jnp.dtype(case.params["dtype"]).name not in PAGED_DTYPES:  # wgmma on f32 would be tf32
      continue
    kernel = functools.partial(paged_cases._ours, "mosaic_gpu", platform)
    params = {**case.params, "impl": "mosaic_gpu"}
    out.append(
      dataclasses.replace(case, op="paged_attention/mosaic_gpu", kernel=kernel, params=params)
    )
  return out
