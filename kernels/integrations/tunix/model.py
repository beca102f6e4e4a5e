"""What the loss needs from a tunix model: the logits or the final-norm hidden states of the
positions that score the completion, and the LM head's [D, V] weight.

Inputs follow tunix's ``common.compute_per_token_logps`` (0.1.7) exactly: ``process_ids`` builds the
tokens, positions and causal mask; ``segment_ids`` are passed where the model's ``__call__`` takes
them (the caller's packing ids, else the non-pad mask); the positions ``[-T-1:-1]`` score the T
completion tokens (packed: ``[:-1]`` scores tokens ``1:``).

Hidden states without logits, by what the model offers: ``skip_lm_head=True`` (tunix main), else
``output_hidden_states=True`` and the sown ``all_hidden_states`` (0.1.7's Qwen2 / Qwen3 / Gemma3; the
logits are computed but unused, so ``jit`` removes them), else the Llama3 layer stack run directly
(0.1.7's Llama3 has neither).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx
from tunix.rl import common


class Scored(NamedTuple):
  """The [B, T] rows the loss sees (packed: the buffer minus its first token)."""

  ids: object  # [B, T] int: the scored tokens
  packed: bool


def _accepts(model, name: str) -> bool:
  try:
    params = inspect.signature(model.__call__).parameters
  except (TypeError, ValueError):
    return False
  return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def model_inputs(model, example, pad_id: int, eos_id: int):
  """(tokens [B, L], kwargs for model.__call__, Scored) as tunix's compute_per_token_logps."""
  seg = getattr(example, "segment_ids", None)
  seg_pos = getattr(example, "segment_positions", None)
  tokens, positions, attn_mask, input_seg = common.process_ids(
    example.prompt_ids, example.completion_ids, pad_id, eos_id, seg, seg_pos
  )
  kwargs = dict(positions=positions, cache=None, attention_mask=attn_mask)
  if _accepts(model, "segment_ids"):
    if seg is not None:
      kwargs["segment_ids"] = seg
    elif input_seg is not None:
      kwargs["segment_ids"] = input_seg
  packed = seg is not None
  keep = tokens.shape[1] - 1 if packed else example.completion_ids.shape[1]
  return tokens, kwargs, Scored(tokens[:, -keep:], packed)


def _scoring_rows(x, scored: Scored):  # [B, L, ...] -> [B, T, ...]
  keep = scored.ids.shape[1]
  return x[:, -keep - 1 : -1]


def logits(model, example, pad_id: int, eos_id: int):
  """(logits [B, T, V] as the model returns them, Scored)."""
  tokens, kwargs, scored = model_inputs(model, example, pad_id, eos_id)
  out, _ = model(tokens, **kwargs)
  return _scoring_rows(out, scored), scored


def hidden_states(model, example, pad_id: int, eos_id: int):
  """(final-norm hidden states [B, T, D], Scored), without the [B, L, V] logits under jit."""
  tokens, kwargs, scored = model_inputs(model, example, pad_id, eos_id)
  if _accepts(model, "skip_lm_head"):
    hidden, _ = model(tokens, skip_lm_head=True, **kwargs)
  elif _accepts(model, "output_hidden_states"):
    model(tokens, output_hidden_states=True, **kwargs)  # the logits are dead code under jit
    sown = nnx.pop(model, nnx.Intermediate)
    hidden = _only(sown, "all_hidden_states")
  elif all(hasattr(model, a) for a in ("embedder", "layers", "final_norm")):
    hidden = _layer_stack(model, tokens, kwargs)
  else:
    raise ValueError(
      f"grpo_kernels_fused needs the final-norm hidden states of {type(model).__name__}: its "
      "__call__ takes neither skip_lm_head nor output_hidden_states, and it has no "
      "embedder / layers / final_norm to run (use policy_loss_fn='grpo_kernels' instead)"
    )
  return _scoring_rows(hidden, scored), scored


def _only(state, name: str):
  """The one array sown under ``name`` (nnx stores sown values as a tuple)."""
  found = [v for path, v in nnx.to_flat_state(state) if name in path]
  if len(found) != 1:
    raise ValueError(f"expected one sown {name!r}, found {len(found)}")
  value = found[0].get_value() if hasattr(found[0], "get_value") else found[0]
  return value[-1] if isinstance(value, tuple) else value


def _layer_stack(model, tokens, kwargs):
  """0.1.7's Llama3.__call__ without its head: embed, the decoder layers, the final norm."""
  if "segment_ids" in kwargs and not _accepts(model.layers[0], "segment_ids"):
    kwargs = {k: v for k, v in kwargs.items() if k != "segment_ids"}
  x = model.embedder.encode(tokens)
  for layer in model.layers:
    _, x = layer(x, kwargs["positions"], None, kwargs["attention_mask"])
  return model.final_norm(x)


def lm_head(model, dtype):  # -> [D, V] in dtype
  """The LM head as [D, V]: ``model.lm_head.w`` (untied Einsum head), else the tied
  ``model.embedder.input_embedding`` [V, D] transposed. Cast to ``dtype`` (the hidden states'),
  as the models cast the weight to their compute dtype before the head's matmul."""
  head = getattr(model, "lm_head", None)
  if head is not None:
    w = getattr(head, "w", None)
    if w is None or getattr(head, "bias", None) is not None:
      raise ValueError(
        f"grpo_kernels_fused supports an Einsum LM head (lm_head.w [D, V], no bias); "
        f"{type(model).__name__}.lm_head is a {type(head).__name__}"
      )
    return jnp.asarray(w[...], dtype)
  emb = getattr(getattr(model, "embedder", None), "input_embedding", None)
  if emb is None:
    raise ValueError(
      f"{type(model).__name__} has neither lm_head.w nor a tied embedder.input_embedding"
    )
  return jnp.asarray(emb[...], dtype).T


def example_rows(ex, scored: Scored) -> dict:
  """The per-token arrays of a tunix train example on the scored rows: tunix's [B, T] arrays, or
  with packing its [B, L] arrays without their first position (no token predicts it; tunix scores
  it with log p = 0, so its completion_mask there must be 0 — it is the first prompt token of the
  buffer)."""
  cut = (lambda a: None if a is None else a[:, 1:]) if scored.packed else (lambda a: a)
  adv = jnp.asarray(ex.advantages)
  return dict(
    mask=cut(ex.completion_mask),
    advantages=cut(adv) if adv.ndim == 2 else adv,
    old=cut(ex.old_per_token_logps),
    ref=cut(ex.ref_per_token_logps),
    weights=cut(getattr(ex, "sampler_is_weights", None)),
  )


def unpack(x, scored: Scored):  # [B, T'] -> tunix's per-token layout
  """Our per-token values in tunix's layout: packed rows get back their first position (0, as
  tunix's log p there)."""
  return jnp.pad(x, ((0, 0), (1, 0))) if scored.packed else x
