"""HF-layout checkpoints: names, round trips (single file and sharded with an index), sharded loading."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from bench.tolerances import assert_close
from rl.model import init_model, load_checkpoint, preset, save_checkpoint
from rl.model.partition import path_name, spec_for
from rl.sharding import make_mesh


def _params(model):
  return {
    path_name(p): np.asarray(v)
    for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
  }


def test_hf_tensor_names_and_layout(tmp_path):
  model = init_model(preset("tiny"))
  save_checkpoint(model, tmp_path, dtype=None)
  sd = load_file(str(tmp_path / "model.safetensors"))
  cfg = model.cfg
  assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (cfg.hidden_size, cfg.hidden_size)
  assert sd["model.layers.1.self_attn.k_proj.bias"].shape == (cfg.num_kv_heads * cfg.dim_per_head,)
  assert sd["model.layers.0.mlp.down_proj.weight"].shape == (cfg.hidden_size, cfg.intermediate_size)
  assert sd["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
  assert "lm_head.weight" not in sd  # tied, as HF writes Qwen2.5-0.5B
  np.testing.assert_array_equal(
    sd["model.layers.0.mlp.up_proj.weight"], np.asarray(model.layers.mlp.up_proj.kernel[0]).T
  )
  # Layer i of the stacked array is HF's layer i (a transposed or shifted stack axis would differ).
  np.testing.assert_array_equal(
    sd["model.layers.1.self_attn.k_proj.bias"], np.asarray(model.layers.self_attn.k_proj.bias[1])
  )
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["model_type"] == "qwen2" and hf["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])
@pytest.mark.parametrize("max_shard_bytes", [2**40, 64 * 1024])
def test_round_trip(name, max_shard_bytes, tmp_path):
  model = init_model(preset(name), seed=7)
  files = save_checkpoint(model, tmp_path, dtype=None, max_shard_bytes=max_shard_bytes)
  assert (len(files) > 1) == (tmp_path / "model.safetensors.index.json").exists()
  loaded = load_checkpoint(tmp_path)
  assert loaded.cfg == model.cfg
  a, b = _params(model), _params(loaded)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_bf16_checkpoint_loads_into_f32_params(tmp_path):
  model = init_model(preset("tiny"), seed=8)
  save_checkpoint(model, tmp_path)  # bf16 on disk, like published Qwen checkpoints
  loaded = load_checkpoint(tmp_path, param_dtype="float32")
  for k, v in _params(loaded).items():
    assert v.dtype == np.float32
    np.testing.assert_array_equal(
      v, _params(model)[k].astype(jnp.bfloat16).astype(np.float32), err_msg=k
    )


def test_load_onto_mesh_places_every_parameter_by_the_rules(tmp_path):
  model = init_model(preset("tiny-qwen3", dtype="float32"), seed=9)
  save_checkpoint(model, tmp_path, dtype=None)
  mesh = make_mesh(dp=2, fsdp=2, tp=2)
  loaded = load_checkpoint(tmp_path, mesh=mesh, dtype="float32")
  q = loaded.layers.self_attn.q_proj.kernel[...]  # [L, H, Hq * D]: the layer axis is never sharded
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp")
  for path, v in jax.tree_util.tree_leaves_with_path(nnx.state(loaded, nnx.Param)):
    assert v.sharding.spec == spec_for(path_name(path), v.shape, mesh)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 8)))
  fwd = nnx.jit(lambda m, t: m.logits(m(t)))
  # Sharded matmuls reduce in another order: equal up to f32 accumulation.
  cfg = model.cfg
  assert_close(
    fwd(loaded, tokens),
    fwd(model, tokens),
    "value",
    jnp.float32,
    max(cfg.hidden_size, cfg.intermediate_size) * cfg.num_layers,
  )


def test_partition_rules_drop_axes_that_do_not_divide():
  mesh = make_mesh(dp=1, fsdp=2, tp=4)
  assert spec_for("layers.0.self_attn.k_proj.kernel", (64, 6), mesh) == jax.sharding.PartitionSpec(
    "fsdp", None
  )
  # Stacked layers: the rule applies after the [L] axis, which stays unsharded even where fsdp
  # divides L (sharding it would make every layer of the scan a cross-device gather).
  assert spec_for("layers.mlp.up_proj.kernel", (4, 64, 8), mesh) == jax.sharding.PartitionSpec(
    None, "fsdp", "tp"
  )
  with pytest.raises(ValueError, match="no partition rule"):
    spec_for("layers.0.new_thing.kernel", (4, 4), mesh)


def test_load_errors_name_the_problem(tmp_path):
  model = init_model(preset("tiny"))
  save_checkpoint(model, tmp_path, dtype=None)
  sd = load_file(str(tmp_path / "model.safetensors"))
  missing = dict(sd)
  del missing["model.layers.1.mlp.gate_proj.weight"]
  save_file(missing, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="gate_proj"):
    load_checkpoint(tmp_path)
  save_file(
    {**sd, "model.layers.9.mlp.gate_proj.weight": sd["model.layers.1.mlp.gate_proj.weight"]},
    str(tmp_path / "model.safetensors"),
  )
  with pytest.raises(ValueError, match="does not use"):
    load_checkpoint(tmp_path)
  wrong = dict(sd, **{"model.norm.weight": np.ones(3, np.float32)})
  save_file(wrong, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="shape"):
    load_checkpoint(tmp_path)
  with pytest.raises(FileNotFoundError):
    load_checkpoint(tmp_path / "nowhere")


@pytest.mark.parametrize(
  "file,keep",
  [
    ("model.safetensors", 0.5),  # data cut off
    ("model.safetensors", 4 / 2**20),  # header cut off (4 bytes)
    ("config.json", 0.5),
    ("model.safetensors.index.json", 0.5),
  ],
)
def test_truncated_files_are_named_in_the_error(tmp_path, file, keep):
  """A half-written checkpoint directory: the error names the file, whichever it is."""
  model = init_model(preset("tiny"), seed=11)
  sharded = file.endswith("index.json")
  save_checkpoint(model, tmp_path, dtype=None, max_shard_bytes=64 * 1024 if sharded else 2**40)
  path = tmp_path / file
  data = path.read_bytes()
  path.write_bytes(data[: max(int(len(data) * keep), 4)])
  with pytest.raises(ValueError, match=re.escape(str(path))):
    load_checkpoint(tmp_path)


def test_logits_match_transformers_when_installed(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  for name in ["tiny", "tiny-qwen3"]:
    model = init_model(preset(name, dtype="float32"), seed=10)
    save_checkpoint(model, tmp_path / name, dtype="float32")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / name, torch_dtype=torch.float32
    )
    tokens = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (2, 10))
    with torch.no_grad():
      expected = hf_model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(
      model.logits(model(jnp.asarray(tokens))), expected, rtol=1e-4, atol=1e-4
    )
