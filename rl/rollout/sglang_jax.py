"""sglang-jax as an in-process rollout backend (`rollout.backend: sglang_jax`), with in-memory weight sync.

The way TPU RL recipes roll out (Tunix's SGLang-JAX sampler): sglang-jax's `Engine` runs as a library in
this process (`enable_single_process=True`: scheduler threads, no server, no tokenizer), starts on dummy
weights, and before each `generate` the trainer's current parameters are written into its model runner
(`model_runner.model_state_leaves`, the flat list its jitted forward reads on every call). Nothing is
restarted or recompiled; each leaf is placed on the engine's own sharding with `jax.device_put` (same
dtype on one device: the engine then reads our buffer, no copy, for the unstacked embedding, head and
final norm; each layer's tensor is a slice of our stacked [L, ...] parameter, one copy per sync), cast
or transposed only where dtype or layout differ (a bf16 engine over f32 master weights costs one cast
per sync), and a sync that finds no new parameter arrays does nothing.

Parameter names: ours are HF's up to the stacked layer axis (`weight_plan` maps layer i of
`layers.mlp.up_proj.kernel` to `model.layers.i.mlp.up_proj.weight`; see rl.model.checkpoint.hf_name)
with flax leaf names; sglang-jax's
Qwen2 / Qwen3 keep HF's module paths with `weight` ([in, out], like ours), `scale` (norms),
`embedding` (token embedding, and an untied `lm_head` stored [V, H], ours is [H, V]). With tied
embeddings sglang-jax has no lm_head and reads the embedding, as we do. Every one of our parameters must
land on exactly one sglang leaf of the same shape, and every sglang weight must receive one: anything
else is an error, never a silent partial sync (a stale untied head is the classic bug).

Differences from the `paged` / `dense` backends, by design of sglang-jax 0.1.0rc0:
  * sampling draws are sglang's (it is given a seed per sample from (seed, sample_index)), so sampled
    tokens differ from ours, and on CPU they also differ between two calls with the same requests and
    seeds (5 of 6 repeats, measured); greedy outputs match ours token for token (tested);
  * the log-probs are under softmax(logits / temperature) without top-k / top-p / min-p
    renormalisation (equal to ours when nothing filters, and for greedy), and there are no support
    gaps: the trainer replays the filter on its old-policy logits to form them (rl.support);
  * stop strings are applied after generation (the engine runs without a tokenizer); prefill / decode
    time are not separated in the stats (only the total);
  * its scheduler thread polls for requests without sleeping (one CPU core busy while the engine is
    idle, e.g. during the update), and `Engine.shutdown()` does not stop it in single-process mode:
    after `close()` the thread keeps polling until the process exits. Harmless on an accelerator host
    with cores to spare, visible on a small CPU machine; the bench times sglang_jax after the others.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
from flax import nnx

from rl.model import partition
from rl.model.checkpoint import hf_name
from rl.rollout.engine import RolloutEngine, Seq
from rl.rollout.types import RolloutStats, SamplingParams

SUPPORTED_MODELS = ("qwen2", "qwen3")
_WEIGHT_LEAVES = ("weight", "bias", "scale", "embedding")  # sglang state leaves that are weights
_ATTENTION = {"tpu": ("fa", 128)}  # platform -> (attention backend, page size); elsewhere native, 1


class PlanEntry(NamedTuple):
  """One sglang-jax weight and where it comes from."""

  leaf: int  # index into the runner's flat state leaves
  name: str  # our parameter
  layer: (
    int | None
  )  # the index on our stacked [L] axis (sglang keeps one tensor per layer), or None
  transpose: bool  # sglang's array is ours transposed


def weight_plan(
  ours: dict[str, tuple[int, ...]], theirs: dict[str, tuple[int, tuple[int, ...]]]
) -> list[PlanEntry]:
  """The sync plan from our parameters (name -> shape; stacked layers [L, ...]) to sglang-jax's
  weights (state path -> (flat index, shape)): every one of ours, layer by layer, lands on exactly one
  of theirs of the same shape and every sglang weight is filled, else a ValueError naming the first
  misfit (never a silent partial sync)."""
  plan, used = [], set()
  for name, shape in ours.items():
    num_layers = shape[0] if partition.is_stacked(name) else 0
    for layer_name, layer in partition.per_layer(name, num_layers):
      target, transpose = sglang_path(layer_name)
      if target not in theirs:
        raise ValueError(
          f"parameter {layer_name} maps to sglang-jax {target!r}, which its model does not have "
          f"(its weights: {sorted(k for k in theirs if 'layers.1.' not in k)[:12]} ...)"
        )
      i, want = theirs[target]
      have = shape if layer is None else shape[1:]
      have = tuple(have[::-1] if transpose else have)
      if tuple(want) != have:
        raise ValueError(
          f"parameter {layer_name} {have} (as sglang's) does not fit sglang-jax {target} "
          f"{tuple(want)} (padded or replicated heads, e.g. tp_size > num_kv_heads, are not "
          "supported)"
        )
      plan.append(PlanEntry(i, name, layer, transpose))
      used.add(target)
  missed = [k for k in theirs if k not in used and k.rsplit(".", 1)[-1] in _WEIGHT_LEAVES]
  if missed:
    raise ValueError(f"sglang-jax weights with no parameter of ours to fill them: {missed[:8]}")
  return plan


def _import_engine():
  try:
    from sgl_jax.srt.entrypoints.engine import Engine
  except ImportError as e:
    raise ImportError(
      "rollout.backend=sglang_jax needs sglang-jax (Python >= 3.12): "
      "pip install -e '.[sglang]' (see docs/rollout.md, the sglang_jax backend)"
    ) from e
  return Engine


def sglang_path(our_name: str) -> tuple[str, bool]:
  """Our parameter name -> (sglang-jax state path, whether sglang's array is ours transposed)."""
  hf, _ = hf_name(our_name)
  if hf == "lm_head.weight":
    return "lm_head.embedding", True  # sglang keeps HF's [V, H]; ours is [H, V]
  leaf = hf.rsplit(".", 1)[-1]
  base = hf[: -len(leaf) - 1]
  if base.endswith("embed_tokens"):
    return f"{base}.embedding", False
  if base.endswith("norm"):
    return f"{base}.scale", False
  return (
    f"{base}.{leaf}",
    False,
  )  # linear weight / bias: sglang stores HF's [out, in] as [in, out], as we do


def completion_logprobs(entries: Sequence, tokens: Sequence[int]) -> list:
  """The `(logprob, token id, ...)` entries of `tokens` out of sglang-jax's `output_token_logprobs`.

  sglang-jax 0.1.0rc0 (non-streamed, in-process) sends a completion's log-probs again at every
  `I`-th token (I = 50, its forced stream interval), the whole list so far each time, and its client
  appends them: a completion of n tokens comes back as the prefixes of length I, 2I, ..., kI < n, then
  all n. The last n entries are the completion's; the rest must be exactly those prefixes, and the
  entries' token ids must be `tokens` — anything else is an error, never a guess.
  """
  n, extra = len(tokens), len(entries) - len(tokens)
  if extra < 0:
    raise RuntimeError(f"sglang-jax returned {n} tokens but only {len(entries)} log-probs")
  full = list(entries[extra:])
  if extra and not any(
    _repeated_prefixes(entries[:extra], full, interval) for interval in range(1, n)
  ):
    raise RuntimeError(
      f"sglang-jax returned {n} tokens but {len(entries)} log-probs that are not its "
      "repeated-prefix pattern"
    )
  if [int(x[1]) for x in full] != list(tokens):
    raise RuntimeError("sglang-jax's log-probs name other tokens than its output ids")
  return full


def _repeated_prefixes(head: Sequence, full: list, interval: int) -> bool:
  """Whether `head` is full[:I] + full[:2I] + ... + full[:kI] for I = interval and kI < len(full)."""
  lengths = range(interval, len(full), interval)
  if sum(lengths) != len(head):
    return False
  start = 0
  for length in lengths:
    if list(head[start : start + length]) != full[:length]:
      return False
    start += length
  return True


class SglangJaxEngine(RolloutEngine):
  """`generate(prompts, params) -> RolloutResult` on sglang-jax, reading the live model's weights.

  One live engine per process: sglang-jax keeps process-global state (server args, mesh), and a second
  engine beside a running one was seen to generate wrong tokens. `close()` one before making another.
  """

  _live: SglangJaxEngine | None = None
  reports_support_gaps = False  # its log-probs are the full softmax's; the trainer replays the gaps

  def __init__(self, model, config, tokenizer=None, eos_ids=None, *, log_level: str = "error"):
    super().__init__(model, config, tokenizer, eos_ids)
    cfg = model.cfg
    if cfg.model_type not in SUPPORTED_MODELS:
      raise ValueError(
        f"sglang_jax backend supports {SUPPORTED_MODELS}, not model_type={cfg.model_type!r}"
      )
    if cfg.dim_per_head % 128 or cfg.num_kv_heads < 2:
      # 0.1.0rc0 pads narrower heads to 128 lanes in attention but not in dummy-loaded weights, and its KV
      # pool mis-shards a single KV head: both fail deep inside its jitted forward.
      raise ValueError(
        f"sglang-jax 0.1.0rc0 needs head_dim a multiple of 128 and >= 2 KV heads; this model "
        f"has head_dim={cfg.dim_per_head}, num_kv_heads={cfg.num_kv_heads} (e.g. Qwen2.5-1.5B / 3B "
        "/ 7B fit, Qwen2.5-0.5B's head_dim 64 does not; the preset tiny-h128 is the small one)"
      )
    if cfg.batch_invariant:
      raise ValueError(
        "model batch_invariant=True: sglang-jax runs its own forward, which cannot give the "
        "trainer's bits; use the paged or dense backend"
      )
    if jax.process_count() > 1:
      raise ValueError(
        "the sglang_jax backend runs one engine per process on one device; multi-process "
        "runs use the paged backend"
      )
    if config.cache_dtype not in (None, cfg.dtype):
      raise ValueError(
        f"sglang_jax keeps its KV cache in the model dtype ({cfg.dtype}); cache_dtype="
        f"{config.cache_dtype!r} is not supported"
      )
    if SglangJaxEngine._live is not None:
      raise RuntimeError(
        "an sglang_jax engine is already running in this process; close() it first "
        "(sglang-jax keeps process-global state, two engines interfere)"
      )
    Engine = _import_engine()
    platform = jax.default_backend()
    attention, page = _ATTENTION.get(platform, ("native", 1))
    # load_format="dummy" reads only config.json; the weights arrive by sync_weights().
    self._config_dir = tempfile.TemporaryDirectory(prefix="sglang-jax-model-")
    # No eos in its config: the engine stops on exactly the ids each request names (ours), as ours do.
    hf = dict(cfg.to_hf(), torch_dtype=cfg.dtype, eos_token_id=None)
    with open(os.path.join(self._config_dir.name, "config.json"), "w") as f:
      json.dump(hf, f)
    args = dict(
      model_path=self._config_dir.name,
      load_format="dummy",
      skip_tokenizer_init=True,
      enable_single_process=True,
      device=platform,
      dtype=cfg.dtype,
      tp_size=1,
      device_indexes=[jax.devices()[0].id],  # one device, whatever else this process sees
      # + 2: sglang-jax clips max_new_tokens to context - 2 - prompt (and to the pool size - 2);
      # ours allow prompt + new == max_seq_len
      attention_backend=attention,
      page_size=page,
      context_length=config.max_seq_len + 2,
      max_total_tokens=config.max_slots * (config.max_seq_len + 2),
      max_running_requests=config.max_slots,
      grammar_backend="none",
      disable_precompile=platform == "cpu",
      log_level=log_level,
      # With the overlap scheduler on, a loaded machine saw the first engine of a process decode
      # tokens unrelated to the synced weights (4 of 10 tests, 3 runs); off, 3 loaded runs passed.
      disable_overlap_schedule=True,
    )
    if config.sglang_mem_fraction is not None:
      args["mem_fraction_static"] = config.sglang_mem_fraction
    self.engine = Engine(**args)
    SglangJaxEngine._live = self
    self._runner = self.engine.scheduler_info["scheduler"].tp_worker.worker.model_runner
    self._plan = self._weight_plan()
    self._synced: list | None = None
    self.sync_weights()

  # ----------------------------------------------------------------------------------- weights
  def _weight_plan(self) -> list[PlanEntry]:
    flat = jax.tree_util.tree_flatten_with_path(nnx.split(self._runner.model)[1])[0]
    theirs = {partition.path_name(p): (i, tuple(leaf.shape)) for i, (p, leaf) in enumerate(flat)}
    return weight_plan({name: tuple(x.shape) for name, x in self._params().items()}, theirs)

  def _params(self) -> dict:
    """Our parameter name -> the live model's current array."""
    return {
      partition.path_name(p): x
      for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(self.model, nnx.Param))
    }

  def sync_weights(self) -> int:
    """Write the model's current parameters into the engine; returns how many leaves were written
    (0 when nothing changed since the last sync: identical arrays are not resent)."""
    ours = self._params()
    current = [ours[entry.name] for entry in self._plan]
    if self._synced is not None and all(a is b for a, b in zip(current, self._synced)):
      return 0
    leaves = list(self._runner.model_state_leaves)
    for entry, x in zip(self._plan, current):
      dst = leaves[entry.leaf]
      y = x if entry.layer is None else x[entry.layer]
      y = y.T if entry.transpose else y
      if y.dtype != dst.dtype:
        y = y.astype(dst.dtype)
      # Onto the engine's own mesh: its explicit-sharding forward rejects arrays laid out on ours.
      leaves[entry.leaf] = jax.device_put(y, dst.sharding)
    self._runner.model_state_leaves = leaves
    self._synced = current
    # The radix cache holds KV computed with the old weights: reusing a cached prefix would mix policies.
    if not self.engine.flush_cache().success:
      raise RuntimeError("sglang-jax did not flush its prefix cache after a weight sync")
    return len(self._plan)

  # ----------------------------------------------------------------------------------- generation
  def generate(
    self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
  ):
    t0 = time.perf_counter()
    groups = self._requests(prompts, params)
    self.sync_weights()
    seqs = [s for g in groups for s in g]
    outs = self.engine.generate(
      input_ids=[s.prompt for s in seqs],
      sampling_params=[self._sampling(s) for s in seqs],
      return_logprob=True,
    )
    stats = RolloutStats()
    for s, out in zip(seqs, outs, strict=True):
      self._finish(s, out)
      meta = out["meta_info"]
      stats.prefill_tokens += int(meta.get("prompt_tokens", len(s.prompt))) - int(
        meta.get("cached_tokens", 0)
      )
      s.admitted = t0
    return self._result(groups, stats, t0)

  @staticmethod
  def _sampling(s: Seq) -> dict:
    p = s.params
    return dict(
      max_new_tokens=s.limit,
      temperature=p.temperature,
      top_k=p.top_k if p.top_k > 0 else -1,
      top_p=p.top_p,
      min_p=p.min_p,
      stop_token_ids=list(s.stop_ids),
      sampling_seed=(p.seed * 1_000_003 + s.sample_index) % (2**31 - 1),
      skip_special_tokens=False,
    )

  def _finish(self, s: Seq, out: dict) -> None:
    tokens = [int(t) for t in out["output_ids"]]
    entries = completion_logprobs(out["meta_info"]["output_token_logprobs"], tokens)
    # full-softmax log-probs and no support gap (the trainer replays the filter: rl.support)
    self._accept(s, tokens, [float(x[0]) for x in entries], gaps=None)
    reason = out["meta_info"]["finish_reason"] or {}
    if s.finish is None:  # sglang stopped without our rules firing: trust its reason, but say which
      if reason.get("type") == "length" and len(tokens) < s.limit:
        raise RuntimeError(
          f"sglang-jax cut a completion at {len(tokens)} of its {s.limit} tokens (its context "
          "or token-pool limit is below this engine's max_seq_len)"
        )
      s.finish = "length" if reason.get("type") == "length" else "eos"

  def close(self) -> None:
    """Shut the engine down and allow another in this process (its scheduler thread lingers, see above)."""
    if getattr(self, "engine", None) is not None:
      self.engine.shutdown()
      self.engine = None
      SglangJaxEngine._live = None
    self._config_dir.cleanup()
