"""Peer rows: what a user would pick instead of our kernels, timed beside them in the same run.

Each peer is optional: where its package (or a GPU for it) is missing its rows are skipped with the
reason. Closest semantics, since no peer computes the GRPO objective on our terms:

* Liger-Kernel (torch + Triton) ``LigerCrossEntropyLoss`` beside ``grpo_loss``: the sum cross-entropy
  over the same [N, V] logits, i.e. the logsumexp + chosen-logit pass that grpo_loss makes before its
  element-wise [N] objective (which Liger's pass does not include).
* Liger-Kernel ``LigerFusedLinearCrossEntropyLoss`` beside ``fused_linear_grpo_loss``: the LM-head
  matmul fused with that cross-entropy, never storing the [N, V] logits.
* tokamax ``linear_softmax_cross_entropy_loss`` (its GPU kernel, ``implementation=None`` picks it)
  beside ``fused_linear_grpo_loss``, the same fused LM-head cross-entropy in jax.

A row times the peer forward + backward (gradients w.r.t. its inputs) against our kernel's forward +
backward at the same shape and inputs: ``kernel`` is the peer, ``reference`` is ours, so ``speedup`` > 1
means the peer is faster. Parity: the peer's loss against minus the sum of our kernel's per-token
log-probs (the same cross-entropy), under the tolerance table. Torch shares the GPU with jax: the
device call runs this suite with jax's memory fraction capped (``bench.device``), and torch is
imported only after jax has its device.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from bench.kernels import harness
from bench.kernels.cases import Check
from bench.kernels.cases import fused_linear as linear_cases
from bench.kernels.cases import grpo_loss as loss_cases
from bench.kernels.run import CaseResult, ImplResult
from bench.shapes import LINEAR_LOSS_SHAPES, LOSS_SHAPES

SHAPES_BY_SIZE = {
  "tiny": {"grpo_loss": ("tiny",), "fused_linear": ("tiny",)},
  "small": {"grpo_loss": ("cpu-small",), "fused_linear": ("cpu-small",)},
  "large": {
    "grpo_loss": loss_cases.SHAPES_BY_SIZE["large"],
    "fused_linear": linear_cases.SHAPES_BY_SIZE["large"],
  },
}


@dataclasses.dataclass(frozen=True)
class Peer:
  """``missing()``: why it cannot run here (None: it can). ``build(inputs)``: a zero-argument
  function running the peer's forward + backward once on ``inputs`` (our case's jax arrays) and
  returning its loss as a Python float, plus a ``sync()`` that waits for its device work."""

  name: str
  beside: str  # "grpo_loss" | "fused_linear"
  semantics: str
  missing: Callable[[str], str | None]  # platform -> skip reason or None
  build: Callable[[tuple], tuple[Callable[[], float], Callable[[], None]]]


def _module_missing(module: str, platform: str, need_gpu: bool = True) -> str | None:
  if importlib.util.find_spec(module) is None:
    return f"{module} is not installed"
  if need_gpu and platform != "gpu":
    return f"{module}'s kernels need a GPU (this run targets {platform})"
  return None


def _torch_missing(module: str, platform: str) -> str | None:
  reason = _module_missing("torch", platform) or _module_missing(module, platform)
  if reason is None:
    import torch  # after jax owns its device: see the module docstring

    if not torch.cuda.is_available():
      reason = "torch sees no CUDA device"
  return reason


def _torch(x):
  import torch

  return torch.from_dlpack(x)  # the jax buffer, no copy


def _liger_ce(inputs):
  import torch
  from liger_kernel.transformers import LigerCrossEntropyLoss

  logits, ids = inputs[0], inputs[1]  # [B, T, V], [B, T]
  x = _torch(logits).reshape(-1, logits.shape[-1]).clone().requires_grad_(True)  # torch-owned
  target = _torch(ids).reshape(-1).long()
  loss_fn = LigerCrossEntropyLoss(reduction="sum")

  def step():  # Liger writes the gradient into its input in place: later calls time the same work
    loss = loss_fn(x, target)
    loss.backward()
    return float(loss.detach())

  return step, torch.cuda.synchronize


def _liger_flce(inputs):
  import torch
  from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

  hidden, lm_head, ids = inputs[0], inputs[1], inputs[2]  # [B, T, H], [H, V], [B, T]
  h = _torch(hidden).reshape(-1, hidden.shape[-1]).clone().requires_grad_(True)
  w = _torch(lm_head).t().contiguous().requires_grad_(True)  # Liger takes nn.Linear's [V, H]
  target = _torch(ids).reshape(-1).long()
  loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

  def step():
    loss = loss_fn(w, h, target)
    loss.backward()
    return float(loss.detach())

  return step, torch.cuda.synchronize


def _tokamax_lce(inputs):
  import tokamax

  hidden, lm_head, ids = inputs[0], inputs[1], inputs[2]  # [B, T, H], [H, V], [B, T]
  x, labels = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)  # [N, H], [N]
  f = lambda x, w: tokamax.linear_softmax_cross_entropy_loss(x, labels, w, reduction="sum")
  fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  out = []

  def step():
    out[:] = [fn(x, lm_head)]
    return float(out[0][0])

  return step, lambda: jax.block_until_ready(out)


PEERS = (
  Peer(
    "liger-cross-entropy",
    "grpo_loss",
    "sum cross-entropy over the same logits (grpo_loss's logsumexp + chosen-logit pass)",
    functools.partial(_torch_missing, "liger_kernel"),
    _liger_ce,
  ),
  Peer(
    "liger-fused-linear-ce",
    "fused_linear",
    "LM head fused with the sum cross-entropy (fused_linear_grpo_loss's matmul + softmax pass)",
    functools.partial(_torch_missing, "liger_kernel"),
    _liger_flce,
  ),
  Peer(
    "tokamax-linear-softmax-ce",
    "fused_linear",
    "LM head fused with the sum cross-entropy (tokamax's GPU kernel where it has one)",
    functools.partial(_module_missing, "tokamax"),
    _tokamax_lce,
  ),
)


def _ours(beside: str, shape: str, platform: str):
  """(inputs maker, our fwd returning (loss, per-token logps), our fwd+bwd, reduction length)."""
  if beside == "grpo_loss":
    s = LOSS_SHAPES[shape]
    impl = "pallas"
    return (
      functools.partial(loss_cases.make_inputs, s),
      functools.partial(loss_cases._fwd, impl, platform),
      functools.partial(loss_cases._fwd_bwd, impl, platform),
      s.vocab,
    )
  s = LINEAR_LOSS_SHAPES[shape]
  impl = "chunked"
  return (
    functools.partial(linear_cases.make_inputs, s),
    functools.partial(linear_cases._fwd, impl, platform),
    functools.partial(linear_cases._fwd_bwd, impl, platform),
    s.hidden + s.vocab,
  )


def _all_tokens(beside: str, inputs: tuple) -> tuple:
  """``inputs`` with the completion mask all ones: our per-token log-probs are 0 where the mask is
  (the peers' cross-entropy scores every token)."""
  i = 2 if beside == "grpo_loss" else 3  # (logits, ids, mask, adv) / (hidden, head, ids, mask, adv)
  return (*inputs[:i], jnp.ones_like(inputs[i]), *inputs[i + 1 :])


def _time(step, sync, warmup: int, repeats: int) -> harness.Timing:
  for _ in range(warmup):
    step()
  sync()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    step()
    sync()
    times.append(time.perf_counter() - t0)
  q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
  med = statistics.median(times)
  return harness.Timing(med, min(times), max(times), q[2] - q[0], repeats, 0.0, q[0], q[2])


def run_peer(peer: Peer, shape: str, platform: str, *, seed=0, warmup=2, repeats=10) -> CaseResult:
  """One row: the peer beside our kernel at ``shape`` (skipped with its reason where it cannot run)."""
  base = dict(
    name=row_name(peer, shape),
    op=f"peers/{peer.name}",
    shape=shape,
    mode="fwd+bwd",
    params=dict(beside=peer.beside, semantics=peer.semantics),
    bytes=None,
    flops=None,
  )
  none = dict(kernel=None, reference=None, parity={}, speedup=None)
  reason = peer.missing(platform)
  if reason:
    return CaseResult(**base, **none, ok=True, skipped=reason)
  try:
    make, fwd, fwd_bwd, reduction = _ours(peer.beside, shape, platform)
    inputs = make(seed)
    _, logps = jax.jit(fwd)(*_all_tokens(peer.beside, inputs))  # [B, T]: every token scored
    expected = -jnp.sum(logps)  # the cross-entropy our kernel computed, on the device
    exe, compile_s = harness.compile_fn(fwd_bwd, inputs)
    ours = harness.time_compiled(exe, inputs, warmup=warmup, repeats=repeats, compile_s=compile_s)
    step, sync = peer.build(inputs)
    value = step()  # first call: the peer's loss on the untouched inputs
    timing = _time(step, sync, warmup, repeats)
  except Exception as e:  # a broken peer is a failed row, not a crashed run
    return CaseResult(**base, **none, ok=False, error=f"{type(e).__name__}: {e}"[:300])
  check = (Check(0, "value", "float32", reduction, "ce_sum"),)
  parity = harness.device_parity((jnp.float32(value),), (expected,), check)
  mem = harness.Memory(None, None, None, None)
  return CaseResult(
    **base,
    kernel=ImplResult(timing, mem, None, None),
    reference=ImplResult(ours, harness.memory_of(exe), None, None),
    parity=parity,
    ok=all(e <= 1.0 for e in parity.values()),
    speedup=ours.median_s / timing.median_s,
  )


def row_name(peer: Peer, shape: str) -> str:
  return f"peers/{peer.name}/{shape}/fwd+bwd"


def rows(size: str, peers=None) -> list[tuple[Peer, str]]:
  """(peer, shape) pairs this size runs, in order (each becomes one row); default: every PEERS."""
  return [(p, shape) for p in peers or PEERS for shape in SHAPES_BY_SIZE[size][p.beside]]
