"""The policy update: a global batch of scored completions -> micro-batched, gradient-accumulated loss ->
one optimizer step, in one compiled function.

The batch is laid out as [K, M, T]: K gradient-accumulation steps of M sequences (the global
micro-batch, sharded over dp x fsdp). Each row is a prompt left-padded to P tokens followed by its
completion right-padded to C = `max_completion_length` tokens (T = P + C), so the hidden state at
position P - 1 + t scores completion token t for every row.

The loss is normalised over the whole global batch, never per micro-batch: each micro-batch's loss is
scaled so that the K terms sum to the loss of the full batch, hence the summed gradients are the full
batch's gradient whatever K is (tested). `bnpo` and `dapo` both divide by the global count of
completion tokens (TRL's `bnpo` divides per process; summed over micro-batches that is not a mean):
dapo through the kernel's `num_items_in_batch`, bnpo (which divides by its own call's tokens) by
rescaling each micro-batch's loss by its token count over the global one.

The loss is one `kernels.LossSpec` (`LossSettings.spec`), passed to the kernel as is; with the
rollout engine's log-probs in the batch (`Batch.sampler_logps`) its importance correction (`is_mode`)
can act, and the step reports the engine's mismatch (`rl.mismatch`).

An update whose loss or gradient norm is not finite (or whose new weights would not be) is skipped
inside the compiled step: weights and optimizer state come back unchanged and the `nonfinite` metric is
1. `NonFiniteGuard` counts such steps and stops a run after too many in a row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels
from kernels.grpo_loss import token_logps_and_entropy
from rl import mismatch
from rl.optimizer import Optimizer, _global_norm, guarded_step

Objective = Literal["grpo", "sft"]
# Name scopes of the train step's two phases: loss forward + backward over the micro-batches, then
# clipping + the optimizer. Backward ops carry `transpose(` in their scope path (how JAX names VJPs).
LOSS_SCOPE = "grpo_loss_and_grads"
OPTIMIZER_SCOPE = "grpo_optimizer"
MISMATCH_SUM = "mismatch_sum/"  # micro-batch sums of rl.mismatch, reduced after the scan


class Batch(NamedTuple):
  """One step's training data, [K, M, ...] (accumulation step, sequence in the micro-batch)."""

  tokens: jax.Array  # [K, M, T] int32: left-padded prompt (P) + right-padded completion (C)
  attention_mask: jax.Array  # [K, M, T] bool, False on padding
  advantages: jax.Array  # [K, M] f32 (ones for SFT)
  old_logps: jax.Array | None = None  # [K, M, C] f32: the policy before this step's first epoch
  ref_logps: jax.Array | None = None  # [K, M, C] f32: the reference model, when beta > 0
  sampler_logps: jax.Array | None = None  # [K, M, C] f32: the rollout engine's, 0 on padding
  # [K, M, C] f32 support gaps (rl.support, train.score_sampled_support): old, reference and current
  # log-probs score each token over its sampled support; None: the full softmax
  support_gaps: jax.Array | None = None
  # [K, M, C] f32 each, for the mismatch/raw/* and mismatch/truncated/* metrics only: the old
  # policy's full-softmax and truncated log-probs (rl.support.support_pass); None: not reported
  raw_logps: jax.Array | None = None
  truncated_logps: jax.Array | None = None


def pack(
  prompts: Sequence[Sequence[int]],  # N prompts
  completions: Sequence[Sequence[int]],  # N completions
  prompt_width: int,
  completion_width: int,
  pad_id: int,
) -> tuple[np.ndarray, np.ndarray]:
  """Rows of [left-padded prompt | right-padded completion]: ([N, P + C] int32 ids, [N, P + C] mask),
  the layout `Batch` and the loss read. A prompt or completion wider than its slot is an error
  (nothing is cut)."""
  n, width = len(prompts), prompt_width + completion_width
  tokens, mask = np.full((n, width), pad_id, np.int32), np.zeros((n, width), bool)
  for i, (prompt, completion) in enumerate(zip(prompts, completions)):
    if len(prompt) > prompt_width or len(completion) > completion_width:
      raise ValueError(
        f"row {i}: prompt {len(prompt)} / completion {len(completion)} tokens exceed the widths "
        f"{prompt_width} / {completion_width}"
      )
    tokens[i, prompt_width - len(prompt) : prompt_width] = prompt
    tokens[i, prompt_width : prompt_width + len(completion)] = completion
    mask[i, prompt_width - len(prompt) : prompt_width + len(completion)] = True
  return tokens, mask


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """The static part of the loss (hashable: compiled into the step). `spec` is the policy loss
  (kernels.LossSpec: loss type, epsilons, beta, temperature, the mismatch options); its
  max_completion_length is the batch's C (None is filled in, any other value is an error)."""

  completion_len: int  # C
  spec: kernels.LossSpec = dataclasses.field(default_factory=kernels.LossSpec)
  impl: str = "auto"  # kernels.grpo_loss / fused_linear_grpo_loss impl
  fused_lm_head: bool = False
  remat: str = "none"  # rl.model.qwen.REMAT: what each decoder layer keeps for the backward
  # The loss kernels' layout over the run's mesh (rl.kernel_sharding.batch_sharding: rows over the
  # batch axes, the fused loss's vocabulary over tp; None: one device): hashable, compiled in.
  kernel_sharding: Any = None

  def __post_init__(self):
    if not isinstance(self.spec, kernels.LossSpec):
      raise TypeError(
        f"LossSettings.spec must be a kernels.LossSpec, got {type(self.spec).__name__}"
      )
    if self.spec.max_completion_length is None:
      spec = dataclasses.replace(self.spec, max_completion_length=self.completion_len)
      object.__setattr__(self, "spec", spec)
    elif self.spec.max_completion_length != self.completion_len:
      raise ValueError(
        f"spec.max_completion_length={self.spec.max_completion_length} differs from the batch's "
        f"completion_len={self.completion_len}"
      )
    if self.impl == "chunked" and not self.fused_lm_head:
      raise ValueError("policy_loss_impl='chunked' is a fused-LM-head path: set fused_lm_head=true")


def split_completion(
  tokens,  # [M, T]
  attention_mask,  # [M, T]
  completion_len: int,
):  # -> ids [M, C], mask [M, C]
  return tokens[:, -completion_len:], attention_mask[:, -completion_len:]


def completion_hidden(
  model: nnx.Module,
  tokens,  # [M, T]
  attention_mask,  # [M, T]
  completion_len: int,
  remat: str = "none",  # rl.model.qwen.REMAT, for a forward the update differentiates
):  # -> [M, C, H]
  """Hidden states that score the last C tokens (the one before each completion token)."""
  hidden = model(tokens, attention_mask, remat=remat)
  return hidden[:, -completion_len - 1 : -1]


def token_logps(
  model: nnx.Module,
  tokens,  # [M, T]
  attention_mask,  # [M, T]
  completion_len: int,
  temperature: float,
  support_gap=None,  # [M, C] f32 or None: over each token's sampled support (kernels.support)
):  # -> [M, C] f32
  """log pi(completion token) under softmax(logits / temperature) (over the sampled support with
  `support_gap`); 0 on padding. Used for old / ref."""
  ids, mask = split_completion(tokens, attention_mask, completion_len)
  logits = model.logits(completion_hidden(model, tokens, attention_mask, completion_len))
  logp, _ = token_logps_and_entropy(logits, jnp.where(mask, ids, 0), temperature, support_gap)
  return jnp.where(mask, logp, 0.0)


def _micro_loss(
  model, mb: Batch, settings: LossSettings, num_seqs, num_tokens, objective: Objective
):
  """(loss scaled to its share of the global loss, per-micro-batch sums for the metrics)."""
  ids, mask = split_completion(mb.tokens, mb.attention_mask, settings.completion_len)
  hidden = completion_hidden(
    model, mb.tokens, mb.attention_mask, settings.completion_len, settings.remat
  )
  if objective == "sft":
    logits = model.logits(hidden)
    logp, entropy = token_logps_and_entropy(logits, jnp.where(mask, ids, 0), 1.0)
    nll = -jnp.sum(jnp.where(mask, logp, 0.0))
    return nll / num_tokens, {
      "loss": nll / num_tokens,
      "entropy": jnp.sum(jnp.where(mask, entropy, 0.0)),
    }
  spec = settings.spec
  # Scale factors that make the K micro-batch losses sum to the global-batch loss.
  scale = {
    "grpo": ids.shape[0] / num_seqs,  # mean over sequences of per-sequence means
    "dr_grpo": ids.shape[0] / num_seqs,  # sum / (N * C)
    # the kernel divides by the micro-batch's tokens: rescaled to the global count
    "bnpo": jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0) / num_tokens,
    "dapo": 1.0,  # sum / num_items_in_batch = global tokens
  }[spec.loss_type]
  items = num_tokens if spec.loss_type == "dapo" else None
  loss, aux = policy_loss(model, hidden, ids, mask, mb, settings, scale, items)
  sums = {
    "loss": loss,
    "entropy": jnp.sum(aux.entropy),
    "kl": jnp.sum(aux.per_token_kl),
    "clip_fraction": jnp.sum(aux.is_clipped.astype(jnp.float32)),
  }
  if mb.sampler_logps is not None:  # the engine's log-probs against the loss's `old`
    old = mb.old_logps if mb.old_logps is not None else aux.per_token_logps
    weighted = spec.is_mode is not None  # else is_weight is 1, not a weight of the ratio
    found = mismatch.mismatch_sums(
      mb.sampler_logps,
      jax.lax.stop_gradient(old),
      mask,
      aux.is_weight if weighted else None,
      is_level=spec.is_mode.split("_")[0] if weighted else "token",
    )
    if mb.raw_logps is not None:  # the raw and truncated ratios (a filtering sampler)
      found |= mismatch.support_sums(
        mb.sampler_logps,
        mb.raw_logps,
        mb.truncated_logps,
        mask,
        spec.epsilon_low,
        spec.epsilon_high,
      )
    sums.update({MISMATCH_SUM + k: v for k, v in found.items()})
  return loss, sums


def policy_loss(
  model,
  hidden,  # [M, C, H] the states scoring the completion tokens
  ids,  # [M, C] completion tokens
  mask,  # [M, C]
  mb: Batch,
  settings: LossSettings,
  scale,  # [] this micro-batch's share of the global loss
  items,  # [] or None: the global completion tokens (dapo's num_items_in_batch)
):  # -> (loss, kernels' GRPOAux)
  """The policy loss kernel of one micro-batch: kernels.grpo_loss on the logits, or
  kernels.fused_linear_grpo_loss on the hidden states and the LM head. The ONE place the loss
  kernels are called from the update, so the ONE place that hands them the run's mesh
  (`settings.kernel_sharding`: rl.kernel_sharding, shard-local kernels over the batch axes)."""
  kw = dict(
    old_logps=mb.old_logps,
    ref_logps=mb.ref_logps,
    sampler_logps=mb.sampler_logps,
    support_gap=mb.support_gaps,  # None: the full softmax (rl.support passes it only when given)
    spec=settings.spec,
    num_items_in_batch=items,
    impl=settings.impl,
    # the scale goes into the kernels' per-token weights (loss_scale): the loss's cotangent stays 1,
    # so the gradients written in the forward need no rescaling pass over [N, V] (or [H, V])
    loss_scale=scale,
    sharding=settings.kernel_sharding,
  )
  if settings.fused_lm_head:
    weight = model.lm_head_weight()
    return kernels.fused_linear_grpo_loss(
      hidden.astype(weight.dtype),
      weight,
      ids,
      mask,
      mb.advantages,
      **kw,
    )
  return kernels.grpo_loss(model.logits(hidden), ids, mask, mb.advantages, **kw)


def batch_loss_and_grads(
  graphdef, params, batch: Batch, settings: LossSettings, objective: Objective = "grpo"
):
  """Sum over the K micro-batches (a scan) of each one's scaled loss and gradient.

  Returns (grads like params, metrics): metrics are global-batch means per completion token (entropy,
  KL, clip fraction), the total loss, and with `batch.sampler_logps` the `rl.mismatch` statistics of
  the engine's log-probs against the loss's `old` (`mismatch/*`; with ppo_epochs = 1 `old` is the
  trainer's own forward, so they measure exactly the engine's mismatch).
  """
  num_seqs = batch.tokens.shape[0] * batch.tokens.shape[1]
  completion_mask = batch.attention_mask[..., -settings.completion_len :]
  num_tokens = jnp.maximum(jnp.sum(completion_mask.astype(jnp.float32)), 1.0)

  def micro(grads, mb):
    def loss_fn(p):
      model = nnx.merge(graphdef, p)
      return _micro_loss(model, mb, settings, num_seqs, num_tokens, objective)

    (_, sums), micro_grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(jnp.add, grads, micro_grads), sums

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  grads, sums = jax.lax.scan(micro, zeros, batch)
  found = {k[len(MISMATCH_SUM) :]: v for k, v in sums.items() if k.startswith(MISMATCH_SUM)}
  metrics = {k: jnp.sum(v) for k, v in sums.items() if not k.startswith(MISMATCH_SUM)}
  if found:
    metrics.update(mismatch.finish(mismatch.reduce_sums(found)))
  for k in ("entropy", "kl", "clip_fraction"):
    if k in metrics:
      metrics[k] = metrics[k] / num_tokens
  return grads, metrics


def train_step(
  graphdef,
  optimizer: Optimizer,
  settings: LossSettings,
  objective: Objective,
  params,
  opt_state,
  batch: Batch,
):
  """One optimizer step on the global batch: (params, opt_state, metrics). Jit with the first four
  arguments bound (see `compile_train_step`) and params / opt_state donated.

  A non-finite loss or gradient norm, or new weights that overflow, skip the step: params and
  opt_state are returned as they came (rl.optimizer.guarded_step: a select, or a lax.cond around
  the in-place fused kernels; one executable serves both outcomes) and metrics["nonfinite"] is 1.0
  (else 0.0)."""
  # The scopes name the step's phases in the compiled ops (bench.trace splits a profile by them).
  with jax.named_scope(LOSS_SCOPE):
    grads, metrics = batch_loss_and_grads(graphdef, params, batch, settings, objective)
  with jax.named_scope(OPTIMIZER_SCOPE):
    grad_norm = _global_norm(grads)
    grads = jax.tree.map(lambda grad, p: grad.astype(p.dtype), grads, params)
    inputs_ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    params, opt_state, finite = guarded_step(optimizer, params, grads, opt_state, inputs_ok)
  metrics["grad_norm"] = grad_norm
  metrics["nonfinite"] = jnp.logical_not(finite).astype(jnp.float32)
  return params, opt_state, metrics


class NonFiniteError(RuntimeError):
  """Too many updates in a row had a non-finite loss or gradient norm."""


class NonFiniteGuard:
  """Counts steps whose update was skipped (`train_step`'s `nonfinite` metric): `total` over the run
  and `in_a_row`; `check` raises NonFiniteError once `max_in_a_row` were skipped in a row."""

  def __init__(self, max_in_a_row: int, what: str = "step"):
    if max_in_a_row < 1:
      raise ValueError(f"max_in_a_row must be >= 1, got {max_in_a_row}")
    self.max_in_a_row, self.what = max_in_a_row, what
    self.total = self.in_a_row = 0

  def update(self, skipped: bool) -> None:
    self.total += int(skipped)
    self.in_a_row = self.in_a_row + 1 if skipped else 0

  def check(self, step: int) -> None:
    if self.in_a_row >= self.max_in_a_row:
      raise NonFiniteError(
        f"{self.what} {step}: {self.in_a_row} {self.what}s in a row had a non-finite loss or "
        f"gradient norm and were skipped (train.max_nonfinite_steps={self.max_in_a_row}); the "
        "weights are the last finite ones. Lower the learning rate, or check the data and rewards."
      )


def compile_train_step(
  graphdef,
  optimizer: Optimizer,
  settings: LossSettings,
  objective: Objective = "grpo",
  state_shardings=None,
):
  """The jitted `train_step(params, opt_state, batch)`. `state_shardings` = (params', opt_state's
  shardings) pins the outputs to the inputs' layout, so step 2 reuses step 1's executable."""
  out = None if state_shardings is None else (*state_shardings, None)
  return jax.jit(
    functools.partial(train_step, graphdef, optimizer, settings, objective),
    donate_argnums=(0, 1),
    out_shardings=out,
  )


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def batch_token_logps(
  graphdef, params, batch: Batch, completion_len: int, temperature: float
):  # -> [K, M, C] f32
  """Per-token log-probs of every completion (old policy / reference model), micro-batch by
  micro-batch; over each token's sampled support where the batch carries `support_gaps`."""
  model = nnx.merge(graphdef, params)

  def one(_, mb):
    return None, token_logps(model, mb[0], mb[1], completion_len, temperature, mb[2])

  xs = (batch.tokens, batch.attention_mask, batch.support_gaps)
  return jax.lax.scan(one, None, xs)[1]
