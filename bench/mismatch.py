"""The training-inference mismatch of every rollout engine: its sampler log-probs of the tokens it drew
against the trainer's teacher-forced forward (`rl.update.token_logps`) on the same weights and tokens.

    python -m bench.mismatch                        # CPU: the tiny model, paged + dense (+ sglang_jax)
    python -m bench.mismatch --engine paged:pallas  # the paged engine on the Pallas kernel (CPU: the
                                                    # interpreter), beside the others
    python -m bench.mismatch --size large           # GPU / TPU: Qwen2.5-0.5B's shape

For each engine, compute dtype (bf16, f32) and sampling (plain temperature 1; top-k + top-p): over every
completion token, with r = trainer - sampler, the mean, p99 and max of |r|, KL(sampler || trainer) by
the k3 estimator (`rl.mismatch`), and mean exp|r|. With top-k / top-p the engine reports the log-prob
under the truncated, renormalised distribution it drew from (`rl.rollout.sampling`), while the trainer
scores the full softmax: that row's mismatch is mostly the filter's own (r = log of the kept mass <= 0)
and is expected. The `filtered` columns separate the two: the max |r| and k3 against the trainer's
logits passed through the same filter, which leaves only the engine's numerical mismatch, and the
count of drawn tokens outside the trainer's filtered set (its logits round differently at the edge of
the top-k / nucleus: in bf16 on a kernel other than the trainer's).

The "truncated (kernel)" rows (issue 48) score each token as the loop does with
`train.score_sampled_support`: the loss op's per-token log-prob entry point
(`kernels.grpo_loss.token_logps_and_entropy`) with the engine's support gaps (`kernels.support`), so
the filter's own log(kept mass) is gone and what is left is the engine's numerical mismatch. sglang_jax
reports full-softmax log-probs and no gaps: the loop replays the gaps and moves its log-probs onto the
replayed support by the same log(kept mass) (rl.support), so its truncated ratio is the full-softmax
one and its row repeats the plain trainer's.

Engines: "paged", "dense", "sglang_jax" (skipped, with the reason, where sglang-jax is not installed or
the model's head_dim is not 128: use --size h128), and "paged:<attn_impl>" for a paged decode attention
other than the default. The random weights are scaled x10 as in bench.rollout.throughput, so distributions are
peaked and the bf16 differences between kernels show.

`--numerics batch-invariant` (with `xla`, the default) adds bf16 rows whose decoder has
`ModelConfig.batch_invariant` (rl.model.numerics): every reduction in a fixed order and every
rounding explicit, so the engines' decode gives each token the trainer's hidden state bit for bit and
what is left is f32 round-off in the logits and the two log-prob formulas (docs/rollout.md).

`--exact-bf16` runs with XLA's excess precision off (`--xla_allow_excess_precision=false`, set before
the backend starts): by default XLA may keep a bf16 value in f32 where it fuses the producer with its
consumer, and it fuses the engine's decode program and the trainer's teacher-forced forward
differently, so the two round the same bf16 activations at different places. Under a top-k / top-p
filter that difference moves tokens across the kept set's edge, which the truncated score amplifies
(a flipped boundary token shifts log p~ by its probability); with the rounding the model asks for on
both sides, the truncated rows fall to the engines' plain numerical mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import provenance
from kernels.grpo_loss import token_logps_and_entropy
from kernels.paged_attention import IMPLS as ATTN_IMPLS
from rl.mismatch import mismatch_metrics
from rl.model import init_model, preset, scale_weights
from rl.rollout import EngineConfig, RolloutResult, SamplingParams, make_engine
from rl.rollout.paged_cache import invariant_refusal
from rl.rollout.sampling import processed_logprobs
from rl.update import completion_hidden, pack, split_completion

SIZES = {
  "tiny": dict(model="tiny", prompts=2, n=2, prompt_len=8, new_tokens=8, page_size=8, steps=4),
  "small": dict(model="tiny", prompts=4, n=4, prompt_len=16, new_tokens=32, page_size=8, steps=8),
  "h128": dict(
    model="tiny-h128", prompts=4, n=4, prompt_len=16, new_tokens=32, page_size=16, steps=8
  ),
  "large": dict(
    model="qwen2.5-0.5b", prompts=16, n=4, prompt_len=128, new_tokens=256, page_size=16, steps=16
  ),
}
ENGINES = ("paged", "dense", "sglang_jax")
NOTE = (
  "|dlogp| = |trainer - sampler| in nats over every completion token; k3 KL = KL(sampler || trainer). "
  "With top-k / top-p the engine reports the log-prob of the truncated, renormalised distribution it "
  "drew from, so that row's mismatch is the filter's and expected; the `filtered` columns compare "
  "with the trainer's logits under the same filter (the engine's numerical mismatch alone). "
  "`truncated (kernel)` rows: the trainer scores each token over its sampled support (the engine's "
  "support gaps; replayed for sglang_jax), as the loop does with train.score_sampled_support."
)
TRUNCATED = ", truncated (kernel)"  # the suffix of a filtered sampling's truncated-trainer row
DTYPES = ("bfloat16", "float32")
# the decoder's numerics: XLA's own reduction orders and roundings, or ModelConfig.batch_invariant
NUMERICS = ("xla", "batch-invariant")
# name -> (top_k, top_p); temperature 1 everywhere, the trainer's
SAMPLINGS = {"plain": (0, 1.0), "top-k 20 + top-p 0.9": (20, 0.9)}


@dataclasses.dataclass
class MismatchRow:
  engine: str
  dtype: str
  sampling: str
  tokens: int
  abs_mean: float  # |trainer - sampler| over completion tokens, nats
  abs_p99: float
  abs_max: float
  k3_kl: float  # KL(sampler || trainer), k3 estimator
  exp_abs_mean: float  # mean exp|trainer - sampler|
  filtered_abs_max: float  # against the trainer's logits under the same top-k / top-p
  filtered_k3_kl: float
  filtered_outside: int  # drawn tokens the trainer's filter excludes (its set differs at the edge)
  skipped: str | None = None  # why the engine did not run
  numerics: str = "xla"  # NUMERICS (tables recorded before the column: xla)


def skip_reason(engine: str, model_cfg) -> str | None:
  backend, _, impl = engine.partition(":")
  if backend == "paged" and model_cfg.batch_invariant and invariant_refusal(impl or "auto"):
    return f"batch-invariant numerics need the model's attention, not {impl or 'auto'}'s kernel"
  if backend != "sglang_jax":
    return None
  if model_cfg.batch_invariant:
    return "sglang-jax runs its own forward (batch-invariant numerics are this decoder's)"
  if importlib.util.find_spec("sglang_jax") is None:
    return "sglang-jax is not installed (the `sglang` extra)"
  if model_cfg.dim_per_head != 128:
    return f"sglang-jax needs head_dim 128, this model has {model_cfg.dim_per_head} (--size h128)"
  return None


def make(model, size: dict, engine: str):
  """An engine with room for the whole workload; `engine` is a backend, or paged:<attn_impl>."""
  backend, _, impl = engine.partition(":")
  if impl and (backend != "paged" or impl not in ATTN_IMPLS):
    raise ValueError(f"engine must be a backend or paged:<one of {ATTN_IMPLS}>, got {engine!r}")
  cfg = EngineConfig(
    backend=backend,
    max_seq_len=size["prompt_len"] + size["new_tokens"],
    max_slots=size["prompts"] * size["n"],
    page_size=size["page_size"],
    steps_per_sync=size["steps"],
    attn_impl=impl or "auto",
  )
  return make_engine(model, cfg, eos_ids=[])


def requests(size: dict, top_k: int, top_p: float, seed: int = 0):
  rng = np.random.default_rng(seed)
  prompts = [
    list(map(int, rng.integers(3, 200, size=size["prompt_len"]))) for _ in range(size["prompts"])
  ]
  params = SamplingParams(
    max_new_tokens=size["new_tokens"], temperature=1.0, top_k=top_k, top_p=top_p, n=size["n"]
  )
  return prompts, params


def trainer_logps(model, result: RolloutResult, size: dict, top_k: int, top_p: float, rows=8):
  """([N, C] the trainer's log-probs of the drawn tokens: plain softmax, under the same filter, and
  over each token's sampled support: the engine's gaps, or replayed), from one teacher-forced
  forward per `rows` completions (one compile, small [rows, C, V] logits)."""
  c = size["new_tokens"]
  gaps = result.padded_gaps(c)
  replay = gaps is None  # sglang_jax: its truncated ratio is the full softmax's (module docstring)
  gaps = np.full((len(result.completions), c), -np.inf, np.float32) if replay else gaps
  tokens, mask = pack(
    [x.prompt_ids for x in result.completions],
    [x.token_ids for x in result.completions],
    size["prompt_len"],
    c,
    pad_id=0,
  )
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(st, t, m, g):  # [rows, T] x2, [rows, C] -> 3 x [rows, C] f32
    mdl = nnx.merge(graphdef, st)
    ids, _ = split_completion(t, m, c)
    logits = mdl.logits(completion_hidden(mdl, t, m, c))  # [rows, C, V] f32
    flat = logits.reshape(-1, logits.shape[-1])
    n = flat.shape[0]
    settings = (jnp.ones(n), jnp.full(n, top_k, jnp.int32), jnp.full(n, top_p), jnp.zeros(n))
    filt = processed_logprobs(flat, *settings).reshape(logits.shape)
    take = lambda lp: jnp.take_along_axis(lp, ids[..., None], axis=-1)[..., 0]
    truncated, _ = token_logps_and_entropy(logits, ids, 1.0, g)
    return take(jax.nn.log_softmax(logits, axis=-1)), take(filt), truncated

  n = len(tokens)
  pad = -n % rows
  tokens, mask, gaps = (np.concatenate([x, np.repeat(x[:1], pad, 0)]) for x in (tokens, mask, gaps))
  outs = [
    forward(state, tokens[i : i + rows], mask[i : i + rows], gaps[i : i + rows])
    for i in range(0, n + pad, rows)
  ]
  return tuple(np.concatenate([np.asarray(o[j]) for o in outs])[:n] for j in range(3))


def measure(model, result: RolloutResult, size: dict, top_k: int, top_p: float) -> list[dict]:
  """The row of the trainer's full softmax, and with a filter also the truncated (kernel) row."""
  plain, filtered, truncated = trainer_logps(model, result, size, top_k, top_p)
  rows = [stats_of(result, size, plain, filtered)]
  if top_k > 0 or top_p < 1.0:
    rows.append(stats_of(result, size, truncated, filtered))
  return rows


def stats_of(result: RolloutResult, size: dict, plain, filtered) -> dict:
  """One row's statistics: the sampler against the trainer's `plain` log-probs ([N, C]), and the
  `filtered` columns against the trainer under the same filter."""
  _, mask, sampler = result.padded(size["new_tokens"])
  stats = {k: float(v) for k, v in mismatch_metrics(sampler, plain, mask).items()}
  # a token the engine kept may fall outside the trainer's top-k / nucleus (-inf there) when their
  # logits round differently at the set's edge: counted apart, the statistics are over the rest
  inside = mask & np.isfinite(filtered)
  vs_filtered = mismatch_metrics(sampler, np.where(inside, filtered, 0.0), inside)
  diff = np.abs(plain - sampler)[mask]
  return dict(
    tokens=int(mask.sum()),
    abs_mean=stats["mismatch/abs_log_ratio_mean"],
    abs_p99=float(np.percentile(diff, 99)) if diff.size else 0.0,
    abs_max=stats["mismatch/abs_log_ratio_max"],
    k3_kl=stats["mismatch/k3_kl"],
    exp_abs_mean=stats["mismatch/exp_abs_log_ratio_mean"],
    filtered_abs_max=float(vs_filtered["mismatch/abs_log_ratio_max"]),
    filtered_k3_kl=float(vs_filtered["mismatch/k3_kl"]),
    filtered_outside=int((mask & ~inside).sum()),
  )


def run(size_name: str, engines=ENGINES, dtypes=DTYPES, samplings=tuple(SAMPLINGS), numerics=None):
  """One row per dtype x numerics x engine x sampling; an engine that cannot run here is one row,
  `skipped`. Batch-invariant numerics run in bf16 only (f32 rounds nothing to a narrower type) and,
  by default (`numerics=None`), on CPU only: on an accelerator the paged engine decodes through a
  kernel, and the invariant p @ v's [B, Hkv, G, T, D, S] products are a CPU-sized setting."""
  size = SIZES[size_name]
  rows = []
  if numerics is None:
    numerics = NUMERICS if jax.default_backend() == "cpu" else ("xla",)
  arms = [(d, n) for d in dtypes for n in numerics if n == "xla" or d != "float32"]
  if not arms:
    raise ValueError(f"no rows to measure: numerics {numerics} run in bf16 only, dtypes {dtypes}")
  for dtype, mode in arms:
    invariant = mode == "batch-invariant"
    cfg = preset(size["model"], dtype=dtype, batch_invariant=invariant)
    model = scale_weights(init_model(cfg, seed=0), 10.0)
    # sglang_jax last: its in-process scheduler thread lingers after close() (see bench.rollout.throughput)
    for name in sorted(engines, key=lambda e: e.startswith("sglang_jax")):
      reason = skip_reason(name, model.cfg)
      if reason:
        nan = [float("nan")] * 7
        rows.append(MismatchRow(name, dtype, "-", 0, *nan, 0, skipped=reason, numerics=mode))
        continue
      engine = make(model, size, name)
      try:
        for sampling in samplings:
          top_k, top_p = SAMPLINGS[sampling]
          result = engine.generate(*requests(size, top_k, top_p))
          for label, found in zip(
            (sampling, sampling + TRUNCATED), measure(model, result, size, top_k, top_p)
          ):
            rows.append(MismatchRow(name, dtype, label, **found, numerics=mode))
      finally:
        engine.close()
  return rows


def markdown(rows: list[MismatchRow]) -> str:
  lines = [
    "| engine | dtype | sampling | tokens | mean abs(dlogp) | p99 | max | k3 KL | mean exp abs(dlogp) "
    "| filtered: max | filtered: k3 KL | filtered: outside |",
    "|" + "---|" * 12,
  ]
  for r in rows:
    dtype = r.dtype if r.numerics == "xla" else f"{r.dtype}, {r.numerics}"
    if r.skipped:
      lines.append(f"| {r.engine} | {dtype} | skipped: {r.skipped} |" + " |" * 9)
      continue
    lines.append(
      f"| {r.engine} | {dtype} | {r.sampling} | {r.tokens} | {r.abs_mean:.2g} | {r.abs_p99:.2g} "
      f"| {r.abs_max:.2g} | {r.k3_kl:.2g} | {r.exp_abs_mean:.4g} | {r.filtered_abs_max:.2g} "
      f"| {r.filtered_k3_kl:.2g} | {r.filtered_outside} |"
    )
  return "\n".join(lines)


EXACT_BF16_FLAG = "--xla_allow_excess_precision=false"


def environment() -> dict:
  """Where the table was measured (the provenance docs/ext/results.py prints above it)."""
  return dict(
    device_kind=jax.devices()[0].device_kind,
    jax=jax.__version__,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    git_commit=provenance.git_commit(),
    xla_flags=os.environ.get("XLA_FLAGS", ""),
  )


def exact_bf16() -> None:
  """Turn XLA's excess precision off for this process (module docstring). XLA reads its flags when
  the first backend starts, so this must run before any computation: refused after one."""
  from jax._src import xla_bridge  # the only place jax says whether a backend has started

  if xla_bridge.backends_are_initialized():
    raise RuntimeError("--exact-bf16: a JAX backend already started; XLA reads its flags once")
  flags = os.environ.get("XLA_FLAGS", "")
  if EXACT_BF16_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {EXACT_BF16_FLAG}".strip()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m bench.mismatch", description=__doc__.split("\n")[0])
  p.add_argument("--size", choices=sorted(SIZES), default=None)
  p.add_argument(
    "--engine",
    action="append",
    help=f"repeatable: a backend or paged:<attn_impl> (default: {' '.join(ENGINES)})",
  )
  p.add_argument("--dtype", action="append", choices=DTYPES)
  p.add_argument(
    "--numerics",
    action="append",
    choices=NUMERICS,
    help="repeatable: the decoder's numerics (default: both on CPU, xla elsewhere; "
    "batch-invariant in bf16 only)",
  )
  p.add_argument("--out", type=pathlib.Path, help="write mismatch.json and mismatch.md here")
  p.add_argument(
    "--exact-bf16",
    action="store_true",
    help="XLA's excess precision off: engine and trainer round bf16 where the model does (docstring)",
  )
  a = p.parse_args(argv)
  if a.exact_bf16:
    exact_bf16()
  size = a.size or ("small" if jax.default_backend() == "cpu" else "large")
  numerics = tuple(a.numerics) if a.numerics else None
  rows = run(size, tuple(a.engine or ENGINES), tuple(a.dtype or DTYPES), numerics=numerics)
  table = markdown(rows)
  mode = ", XLA excess precision off" if a.exact_bf16 else ""
  print(f"engine mismatch, size {size!r} on {jax.devices()[0].device_kind}{mode}\n{table}")
  if a.out:
    a.out.mkdir(parents=True, exist_ok=True)
    rows_out = [dataclasses.asdict(r) for r in rows]
    payload = dict(size=size, exact_bf16=a.exact_bf16, environment=environment(), rows=rows_out)
    payload["workload"] = SIZES[size]
    (a.out / "mismatch.json").write_text(json.dumps(payload, indent=2))
    (a.out / "mismatch.md").write_text(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
