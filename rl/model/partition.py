"""Partition rules: how each decoder weight is laid out over the (dp, fsdp, tp) mesh.

Megatron-style tensor parallelism (column-parallel q/k/v, gate/up and the LM head over the vocabulary;
row-parallel o_proj and down_proj) with the other large dimension sharded over fsdp. Parameters are
replicated over dp. A dimension that a mesh axis does not divide is replicated over that axis instead.
The decoder layers' parameters are stacked (`layers.mlp.up_proj.kernel` is [L, in, out]): their leading
layer axis is never sharded (the layer scan slices it), the rule applies to the rest.
"""

from __future__ import annotations

import re

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

RULES: tuple[tuple[str, P], ...] = (
  (r"^embed_tokens\.embedding$", P("tp", "fsdp")),
  (r"\.self_attn\.[qkv]_proj\.kernel$", P("fsdp", "tp")),
  (r"\.self_attn\.[qkv]_proj\.bias$", P("tp")),
  (r"\.self_attn\.o_proj\.kernel$", P("tp", "fsdp")),
  (r"\.mlp\.(gate|up)_proj\.kernel$", P("fsdp", "tp")),
  (r"\.mlp\.down_proj\.kernel$", P("tp", "fsdp")),
  (r"^lm_head\.kernel$", P("fsdp", "tp")),
  (r"(norm|layernorm)\.scale$", P()),
)


_STACKED = re.compile(
  r"^layers\.(?!\d+\.)"
)  # 'layers.mlp...' is stacked, 'layers.3.mlp...' one layer


def is_stacked(name: str) -> bool:
  """Whether parameter `name` is a stacked decoder-layer parameter (leading [L] axis)."""
  return _STACKED.match(name) is not None


def per_layer(name: str, num_layers: int) -> list[tuple[str, int | None]]:
  """Parameter `name` -> [(one layer's name, its index on the stacked axis)]:
  'layers.mlp.up_proj.kernel' -> [('layers.0.mlp.up_proj.kernel', 0), ...]; any other -> [(name, None)].
  The per-layer names are HF's module paths (`rl.model.checkpoint.hf_name` maps them)."""
  if not is_stacked(name):
    return [(name, None)]
  rest = name[len("layers.") :]
  return [(f"layers.{i}.{rest}", i) for i in range(num_layers)]


def path_name(path: tuple) -> str:
  """A state key path (or a flat-state path) -> 'layers.0.mlp.up_proj.kernel'.

  Accepts plain keys and jax key-path entries; the Variable's own `.value` entry is dropped.
  """
  parts = []
  for p in path:
    if isinstance(p, jax.tree_util.GetAttrKey):
      continue
    parts.append(str(getattr(p, "key", getattr(p, "idx", p))))
  return ".".join(parts)


def spec_for(name: str, shape: tuple[int, ...], mesh: Mesh) -> P:
  """The rule's spec for parameter `name`, with axes that do not divide their dimension dropped (and
  the stacked layer axis, if any, unsharded)."""
  for pattern, spec in RULES:  # noqa: B007 (spec is used after the break)
    if re.search(pattern, name):
      break
  else:
    raise ValueError(
      f"no partition rule matches parameter {name!r}; add one to rl.model.partition.RULES"
    )
  if is_stacked(name):
    spec = P(None, *spec)
  fitted = []
  for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    fitted.append(axis if axis in mesh.shape and dim % mesh.shape[axis] == 0 else None)
  return P(*fitted)


def param_shardings(model: nnx.Module, mesh: Mesh) -> nnx.State:
  """A state of `NamedSharding`s with the structure of the model's parameters."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: NamedSharding(mesh, spec_for(path_name(path), x.shape, mesh)),
    nnx.state(model, nnx.Param),
  )


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
  """Places the model's parameters on `mesh` by the rules (in place) and returns it."""
  state = nnx.state(model, nnx.Param)
  shardings = param_shardings(model, mesh)
  nnx.update(model, jax.device_put(state, shardings))
  return model
