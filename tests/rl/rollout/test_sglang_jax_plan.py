"""sglang-jax's weight plan without sglang-jax: our stacked parameters -> its per-layer weights.

sglang-jax's Qwen2/Qwen3 state is described here from HF's state dict by its documented layout
(HF module paths; linear `weight` [in, out], norms `scale`, `embedding` [V, H], an untied `lm_head`
as `lm_head.embedding` [V, H]), independently of `rl.rollout.sglang_jax.sglang_path`.
"""

import numpy as np
import pytest
from safetensors.numpy import load_file

from rl.model import init_model, preset, save_checkpoint
from rl.rollout.sglang_jax import weight_plan
from tests.rl.model.test_checkpoint import _params


def _sglang_state(sd: dict) -> dict[str, np.ndarray]:
  """HF state dict -> sglang-jax's weights, by path."""
  out = {}
  for name, x in sd.items():
    base = name.rsplit(".", 1)[0]
    if name == "lm_head.weight":
      out["lm_head.embedding"] = x
    elif base.endswith("embed_tokens"):
      out[f"{base}.embedding"] = x
    elif base.endswith("norm"):
      out[f"{base}.scale"] = x
    elif name.endswith(".weight"):
      out[name] = x.T  # torch [out, in] -> [in, out]
    else:
      out[name] = x
  return out


def _plan_inputs(tie: bool, tmp_path):
  model = init_model(preset("tiny", dtype="float32", tie_word_embeddings=tie), seed=5)
  save_checkpoint(model, tmp_path, dtype=None)
  theirs = _sglang_state(load_file(str(tmp_path / "model.safetensors")))
  ours = _params(model)
  return ours, theirs


@pytest.mark.parametrize("tie", [True, False])
def test_plan_fills_every_sglang_weight_with_the_right_layer(tie, tmp_path):
  """Catches a layer slice taken at the wrong index (or along the wrong axis), a missed transpose
  of the untied head, and a weight left unfilled (it would keep sglang's dummy values)."""
  ours, theirs = _plan_inputs(tie, tmp_path)
  paths = list(theirs)
  index = {p: (i, theirs[p].shape) for i, p in enumerate(paths)}
  plan = weight_plan({n: x.shape for n, x in ours.items()}, index)
  assert sorted(e.leaf for e in plan) == list(range(len(paths)))  # each exactly once
  num_layers = next(x.shape[0] for n, x in ours.items() if n.startswith("layers."))
  assert sum(e.layer is not None for e in plan) == num_layers * sum(
    n.startswith("layers.") for n in ours
  )
  for e in plan:
    y = ours[e.name] if e.layer is None else ours[e.name][e.layer]
    y = y.T if e.transpose else y
    np.testing.assert_array_equal(y, theirs[paths[e.leaf]], err_msg=f"{e} -> {paths[e.leaf]}")


def test_plan_misfits_are_errors(tmp_path):
  """A partial sync is never silent: a weight sglang lacks, one we cannot fill, a shape misfit."""
  ours, theirs = _plan_inputs(True, tmp_path)
  shapes = {n: x.shape for n, x in ours.items()}
  index = {p: (i, x.shape) for i, p in enumerate(theirs) for x in [theirs[p]]}
  missing = {k: v for k, v in index.items() if k != "model.layers.1.mlp.up_proj.weight"}
  with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj"):
    weight_plan(shapes, missing)
  extra = {**index, "model.layers.9.mlp.up_proj.weight": index["model.layers.1.mlp.up_proj.weight"]}
  with pytest.raises(ValueError, match="no parameter of ours"):
    weight_plan(shapes, extra)
  i, shape = index["model.layers.0.self_attn.k_proj.weight"]
  wrong = {**index, "model.layers.0.self_attn.k_proj.weight": (i, shape[::-1])}
  with pytest.raises(ValueError, match="does not fit"):
    weight_plan(shapes, wrong)
