"""Hugging Face checkpoints in and out: `config.json` + `*.safetensors` (sharded, with an index).

Tensors are read one at a time with the `safetensors` library, checked against the model's shapes, cast
to the parameter dtype and placed straight onto their sharding, so a checkpoint never has to fit on one
device. Names are HF's; torch Linear weights are [out, in] and ours are [in, out], hence the transposes.
Our stacked decoder-layer parameters ([L, ...], see `rl.model.qwen`) are HF's L per-layer tensors
(`model.layers.{i}.…`), read into and written from slices of the stacked array.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from rl.configlib import read_json_object
from rl.model import partition
from rl.model.config import ModelConfig
from rl.model.qwen import Qwen, abstract_model

INDEX_FILE = "model.safetensors.index.json"
# Non-parameter buffers some exported checkpoints carry; recomputed here, so safe to skip.
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


def hf_name(name: str) -> tuple[str, bool]:
  """Our per-layer parameter name (`partition.per_layer`) -> (HF tensor name, whether the HF tensor is
  our array transposed)."""
  if partition.is_stacked(name):
    raise ValueError(f"{name!r} is a stacked parameter: map each of partition.per_layer(name, L)")
  if name == "lm_head.kernel":
    return "lm_head.weight", True
  leaf = name.rsplit(".", 1)[-1]
  base = name[: -len(leaf)]
  hf_leaf = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}[leaf]
  return f"model.{base}{hf_leaf}", leaf == "kernel"


def _open_safetensors(path: str):
  """A safetensors handle; a truncated or foreign file is a ValueError naming it."""
  try:
    return safe_open(path, framework="numpy")
  except SafetensorError as e:
    raise ValueError(f"{path} is not a readable safetensors file ({e}): truncated?") from e


def _model_config(directory: str, **overrides: Any) -> ModelConfig:
  path = os.path.join(directory, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"no config.json in {directory}")
  try:
    return ModelConfig.from_hf(read_json_object(path), **overrides)
  except (KeyError, TypeError) as e:
    raise ValueError(f"{path} lacks or mistypes a field the model needs: {e}") from e


def _checkpoint_files(directory: str) -> dict[str, str]:
  """HF tensor name -> file holding it, from the index if there is one, else from every shard's header."""
  index = os.path.join(directory, INDEX_FILE)
  if os.path.exists(index):
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has no weight_map object")
    return {name: os.path.join(directory, file) for name, file in weight_map.items()}
  files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {directory}")
  where = {}
  for file in files:
    path = os.path.join(directory, file)
    with _open_safetensors(path) as handle:
      where.update({name: path for name in handle.keys()})  # noqa: SIM118 (a handle, not a dict)
  return where


def load_checkpoint(
  directory: str | os.PathLike,
  config: ModelConfig | None = None,
  mesh: Mesh | None = None,
  **config_overrides: Any,
) -> Qwen:
  """Loads a Qwen2/2.5/3 checkpoint directory into a `Qwen` model.

  Args:
    directory: holds `config.json` and the safetensors shard(s) (with `model.safetensors.index.json` if
      sharded), as written by `save_pretrained` / downloaded from a hub.
    config: the architecture; default: read from `config.json` (with `config_overrides`, e.g. dtypes).
    mesh: if given, each parameter is placed with `rl.model.partition`'s sharding on this mesh.

  Raises:
    ValueError: a tensor is missing, has the wrong shape, or the checkpoint holds tensors the model
      does not use (nothing is silently dropped); a truncated or unreadable config.json, index or
      safetensors file (the message names the file).
  """
  directory = os.fspath(directory)
  cfg = config if config is not None else _model_config(directory, **config_overrides)
  skeleton = abstract_model(cfg)
  graphdef, state = nnx.split(skeleton)
  params = nnx.state(skeleton, nnx.Param)
  shardings = partition.param_shardings(skeleton, mesh) if mesh is not None else None
  where = _checkpoint_files(directory)
  handles: dict[str, Any] = {}
  used = set()

  def tensor(name: str, ours: str, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor `name` in our layout, checked against `shape`."""
    hf, transpose = hf_name(name)
    if hf not in where:
      raise ValueError(f"checkpoint {directory} has no tensor {hf!r} (for {ours})")
    if where[hf] not in handles:
      handles[where[hf]] = _open_safetensors(where[hf])
    try:
      array = handles[where[hf]].get_tensor(hf)
    except SafetensorError as e:
      raise ValueError(f"{where[hf]}: cannot read tensor {hf!r} ({e}): truncated?") from e
    array = array.T if transpose else array
    if array.shape != shape:
      raise ValueError(
        f"tensor {hf!r} has shape {array.shape} (as ours), the model expects {shape}"
      )
    used.add(hf)
    return array

  def read(path, leaf, sharding=None):
    ours = partition.path_name(path)
    layers = partition.per_layer(ours, leaf.shape[0] if partition.is_stacked(ours) else 0)
    array = np.empty(leaf.shape, leaf.dtype)  # filled layer by layer: one host copy per parameter
    for name, i in layers:
      if i is None:
        array[...] = tensor(name, ours, leaf.shape)
      else:
        array[i] = tensor(name, ours, leaf.shape[1:])
    return jax.device_put(array, sharding) if sharding is not None else jax.device_put(array)

  if shardings is None:
    loaded = jax.tree_util.tree_map_with_path(read, params)
  else:
    loaded = jax.tree_util.tree_map_with_path(read, params, shardings)
  unused = sorted(n for n in where if n not in used and not _IGNORED.search(n))
  if cfg.tie_word_embeddings and "lm_head.weight" in unused:
    unused.remove("lm_head.weight")  # some tied checkpoints store the (shared) head too
  if unused:
    raise ValueError(
      f"checkpoint {directory} holds tensors the model does not use: {unused[:8]}"
      f"{' ...' if len(unused) > 8 else ''} (does config.json match the weights?)"
    )
  model = nnx.merge(graphdef, state)
  nnx.update(model, loaded)
  return model


def _hf_tensors(model: Qwen, dtype) -> Iterator[tuple[str, np.ndarray]]:
  for path, value in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
    ours = partition.path_name(path)
    stacked = np.asarray(jax.device_get(value))
    for layer_name, i in partition.per_layer(ours, model.cfg.num_layers):
      name, transpose = hf_name(layer_name)
      array = stacked if i is None else stacked[i]
      array = array.T if transpose else array
      yield name, np.ascontiguousarray(array.astype(dtype if dtype is not None else array.dtype))


def save_checkpoint(
  model: Qwen,
  directory: str | os.PathLike,
  *,
  dtype: str | None = "bfloat16",
  max_shard_bytes: int = 4 * 2**30,
) -> list[str]:
  """Writes the model in HF layout (`config.json`, safetensors shards, index when sharded).

  `dtype` is the stored dtype (HF Qwen checkpoints are bf16; None keeps the parameter dtype). Returns the
  shard file names.
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  np_dtype = {"bfloat16": ml_dtypes.bfloat16}.get(dtype, dtype) if dtype is not None else None
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in _hf_tensors(model, np_dtype):
    if shards[-1] and size + array.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  names = (
    ["model.safetensors"]
    if len(shards) == 1
    else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )
  for file, tensors in zip(names, shards):
    save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
  if len(shards) > 1:
    index = {
      "metadata": {"total_size": sum(a.nbytes for s in shards for a in s.values())},
      "weight_map": {n: f for f, s in zip(names, shards) for n in s},
    }
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)
  hf = model.cfg.to_hf()
  if dtype is not None:
    hf["torch_dtype"] = dtype
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  return names
