"""Rollout throughput: generated tokens/s of the paged engine against the dense reference sampler, in
the same run, on a random model of a real preset's shape (no checkpoint needed).

    python -m bench.rollout.throughput                       # CPU: the tiny model, small batch
    python -m bench.rollout.throughput --size large          # GPU/TPU: Qwen2.5-0.5B shape, 128 x (256 + 512)
    python -m bench.rollout.throughput --size h128 --backend paged --backend sglang_jax --backend dense
                                                  # with sglang-jax (needs head_dim 128: tiny-h128 here,
                                                  # Qwen2.5-1.5B with --size large-h128 on a TPU / GPU)

Two workloads: `fixed` (every completion runs to max_new_tokens: the engines do the same decode work,
so the difference is attention over pages vs the whole dense cache, and the shared group prefill) and
`varied` (per-request max_new_tokens drawn from [max_new/8, max_new], as GRPO completions end at
different lengths: continuous batching refills finished slots, a static batch waits for its longest).
One engine per backend serves both workloads: `warmup` untimed calls (compiles), then `repeats` timed
runs; the median is reported.

Parity on the run's own outputs, so a fast wrong engine never shows as a win (bench.rollout.parity
says why it is built this way): the gate is a separate run of each engine on each workload with the
same weights in float32 compute and "highest" matmul precision, its sampler log-probs against a
teacher-forced forward at the same precision (the tolerance table's f32 "value" budget, or
FLOOR_FACTOR times the forward's own measured re-layout change where that is larger). The timed run
in the model's compute dtype (bf16) reports its divergence from the same forward, in nats and in ulps
of that dtype at the logits' magnitude (report-only: the H100's correct-looking bf16 engines were 2.2
nats, ~8 bf16 ulps of the 0.5B model's |logits| ~ 35, off; CPU 0.2 ulps on the tiny model). The fraction of greedy completions identical
token for token between the backends is reported, not gating. The random weights are scaled x10
(`rl.model.scale_weights`) so the model's distributions are peaked and these checks can catch a wrong
engine; throughput does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import pathlib
import platform
import statistics
import sys
from collections.abc import Callable

import jax
import numpy as np

from bench import trace
from bench.rollout import byte_account
from bench.rollout.parity import GATE_PRECISION, Parity, gate_model, greedy_agreement, parity
from bench.rollout.table import RolloutBenchRow, markdown
from rl.model import init_model, preset, scale_weights
from rl.rollout import EngineConfig, SamplingParams, make_engine, steps

SIZES = {
  "tiny": dict(
    model="tiny", prompts=2, n=2, prompt_len=8, new_tokens=8, page_size=8, steps=4
  ),  # tests
  # preset, prompts, samples per prompt, prompt length, new tokens, slots, page size, steps per sync
  "small": dict(model="tiny", prompts=8, n=2, prompt_len=32, new_tokens=64, page_size=16, steps=8),
  "large": dict(
    model="qwen2.5-0.5b", prompts=32, n=4, prompt_len=256, new_tokens=512, page_size=16, steps=16
  ),
  # shapes sglang-jax 0.1.0rc0 runs (head_dim 128, >= 2 KV heads)
  # float32 on CPU: in bf16 sglang-jax's log-probs were up to 2 nats off a teacher-forced forward at
  # this model's peaked logits (0.64 - 0.99 of the tolerance; paged 0.25 nats), too near the gate
  "h128": dict(
    model="tiny-h128",
    prompts=8,
    n=2,
    prompt_len=32,
    new_tokens=64,
    page_size=16,
    steps=8,
    dtype="float32",
  ),
  "large-h128": dict(
    model="qwen2.5-1.5b", prompts=32, n=4, prompt_len=256, new_tokens=512, page_size=16, steps=16
  ),
}
BACKENDS = (
  "paged",
  "dense",
)  # the default comparison; the last named backend is the greedy reference


def workload(size: dict, kind: str, seed: int = 0):
  rng = np.random.default_rng(seed)
  prompts = [
    list(map(int, rng.integers(3, 200, size=size["prompt_len"]))) for _ in range(size["prompts"])
  ]
  new = size["new_tokens"]
  lens = (
    [new] * len(prompts)
    if kind == "fixed"
    else list(map(int, rng.integers(new // 8, new + 1, len(prompts))))
  )
  params = [
    SamplingParams(max_new_tokens=m, temperature=1.0, n=size["n"], seed=i)
    for i, m in enumerate(lens)
  ]
  return prompts, params


def step_account(model, engine) -> byte_account.StepAccount | None:
  """The byte account of `engine`'s decode step at its compiled shape (paged / dense only)."""
  ecfg = engine.config
  if ecfg.backend not in ("paged", "dense"):
    return None
  context = ecfg.pages_per_seq * ecfg.page_size
  if ecfg.backend == "paged" and jax.devices()[0].platform == "tpu":
    return tpu_step_account(model, engine)
  with steps.precision_scope(ecfg.matmul_precision):
    return byte_account.account(
      model.cfg, ecfg.backend, ecfg.max_slots, context, ecfg.page_size, ecfg.steps_per_sync
    )


def tpu_step_account(model, engine):
  """On a TPU: the compiled decode step's bytes from rl.aot.decode_bytes.decode_account (the TPU compiler's
  cost analysis, the paged kernel's KV reads added) instead of XLA:CPU's byte account: the floor
  check of the rollout on the platform it runs on. The same (ideal, accessed, ratio) row fields."""
  import types

  from rl.aot.decode_bytes import decode_account

  with steps.precision_scope(engine.config.matmul_precision):
    a = decode_account(engine.config, model.cfg, jax.devices()[0])
  accessed, ideal = a["decode_bytes_per_step"], a["decode_ideal_bytes_per_step"]
  return types.SimpleNamespace(ideal=ideal, accessed=accessed, ratio=accessed / ideal)


WORKLOADS = ("fixed", "varied")


def bench_model(size_name: str):
  """The size's random model, weights scaled x10 so its distributions are peaked (parity means something)."""
  size = SIZES[size_name]
  overrides = {"dtype": size["dtype"]} if "dtype" in size else {}
  return scale_weights(init_model(preset(size["model"], **overrides), seed=0), 10.0)


def bench_engine(model, size_name: str, backend: str, precision: str | None = None):
  """An engine with room for the whole workload at once; no EOS, so every request runs to its length.
  `precision`: EngineConfig.matmul_precision (the parity gate's engine runs at GATE_PRECISION)."""
  size = SIZES[size_name]
  cfg = EngineConfig(
    backend=backend,
    max_seq_len=size["prompt_len"] + size["new_tokens"],
    max_slots=size["prompts"] * size["n"],
    page_size=size["page_size"],
    steps_per_sync=size["steps"],
    matmul_precision=precision,
  )
  return make_engine(model, cfg, eos_ids=[])


def gate(gate_engine, size: dict, kind: str) -> Parity:
  """The parity gate of one engine and workload: `gate_engine` (the backend's engine on the f32 twin
  of the bench model, at GATE_PRECISION) generates the workload once; its log-probs against the
  teacher-forced forward at the same precision."""
  prompts, params = workload(size, kind)
  res = gate_engine.generate(prompts, params)
  return parity(
    gate_engine.model,
    res,
    size["prompt_len"],
    size["new_tokens"],
    precision=gate_engine.config.matmul_precision,
  )


def gates(twin, size_name: str, backend: str, kinds=WORKLOADS) -> dict[str, Parity]:
  """The parity gate of `backend` on each workload in `kinds`: one engine on `twin` (gate_model of
  the bench model) at GATE_PRECISION, closed after."""
  checks = bench_engine(twin, size_name, backend, GATE_PRECISION)
  try:
    return {kind: gate(checks, SIZES[size_name], kind) for kind in kinds}
  finally:
    checks.close()


def _row(model, engine, results, size, kind, acct, gated: Parity) -> RolloutBenchRow:
  """The row of the timed `results`: the median run's times and its report-only parity, the gate's."""
  times = [r.stats.total_s for r in results]
  mid = results[int(np.argsort(times)[len(times) // 2])]
  own = parity(
    model, mid, size["prompt_len"], size["new_tokens"], precision=engine.config.matmul_precision
  )
  st = mid.stats
  nan3 = (float("nan"),) * 3
  return RolloutBenchRow(
    engine.config.backend,
    kind,
    statistics.median(times),
    st.generated_tokens,
    st.generated_tokens / statistics.median(times),
    st.prefill_s,
    st.decode_s,
    st.decode_steps,
    st.preemptions,
    own.err,
    own.max_abs_diff,
    gated.err <= 1.0,
    own.floor,
    *((acct.ideal, acct.accessed, acct.ratio) if acct is not None else nan3),
    1e3 * st.decode_s / max(st.decode_steps, 1),
    own.logit_scale,
    own.rounding_ulps,
    gated.err,
    gated.max_abs_diff,
  )


def run(
  size_name: str,
  repeats: int = 3,
  backends=BACKENDS,
  warmup: int = 2,
  profile: pathlib.Path | None = None,
  on_row: Callable[[RolloutBenchRow], None] | None = None,
) -> tuple[list[RolloutBenchRow], dict]:
  """(one row per workload x backend, {"greedy_agreement": {workload: fraction vs backends[-1]}}).

  One engine per backend serves both workloads, `warmup` untimed calls each (a continuous-batching
  engine meets new batch shapes as requests finish; sglang-jax compiles them lazily on CPU). sglang_jax
  runs last whatever its place in the table: 0.1.0rc0's in-process scheduler thread keeps polling after
  `close()` until the process exits, and would slow every engine timed after it.
  `profile`: after the timed runs, one more generate per backend and workload is traced into
  `profile/<backend>-<workload>/` (read it with `python -m bench.trace`); the timings are untouched.
  `on_row`: called with each row as soon as it is measured (python -m bench saves its report there, so
  a run stopped mid-suite keeps the rows it has).
  """
  size = SIZES[size_name]
  model = bench_model(size_name)
  twin = gate_model(model)
  order = sorted(backends, key=lambda name: name == "sglang_jax")
  found, outs = {}, {kind: {} for kind in WORKLOADS}
  for name in order:
    gated = gates(twin, size_name, name)
    engine = bench_engine(model, size_name, name)
    acct = step_account(model, engine)
    try:
      for kind in WORKLOADS:
        prompts, params = workload(size, kind)
        for _ in range(warmup):
          engine.generate(prompts, params)
        results = [engine.generate(prompts, params) for _ in range(repeats)]
        found[kind, name] = _row(model, engine, results, size, kind, acct, gated[kind])
        if on_row is not None:
          on_row(found[kind, name])
        if profile is not None:
          with (
            trace.capture(str(profile / f"{name}-{kind}")),
            jax.profiler.TraceAnnotation(f"bench/rollout/{kind}/{name}"),
          ):
            engine.generate(prompts, params)
        outs[kind][name] = engine.generate(
          prompts, [dataclasses.replace(p, temperature=0.0) for p in params]
        )
    finally:
      engine.close()
  rows = [found[kind, name] for kind in WORKLOADS for name in backends]
  greedy = {
    kind: {
      name: greedy_agreement(outs[kind][name], outs[kind][backends[-1]]) for name in backends[:-1]
    }
    for kind in WORKLOADS
  }
  return rows, {"greedy_agreement": greedy, "reference": backends[-1]}


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m bench.rollout.throughput", description=__doc__.split("\n")[0]
  )
  p.add_argument("--size", choices=sorted(SIZES), default=None)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument(
    "--warmup", type=int, default=2, help="untimed generate() calls per backend and workload"
  )
  p.add_argument(
    "--backend",
    action="append",
    choices=("paged", "dense", "sglang_jax"),
    help="repeatable, in table order; the last is the greedy-agreement reference "
    f"(default: {' '.join(BACKENDS)})",
  )
  p.add_argument(
    "--out", type=pathlib.Path, default=None, help="write results.json and summary.md here"
  )
  p.add_argument(
    "--profile",
    type=pathlib.Path,
    default=None,
    help="trace one extra generate per backend and workload into PROFILE/<backend>-<workload>/ "
    "(after the timed runs; summarise with python -m bench.trace)",
  )
  a = p.parse_args(argv)
  size = a.size or ("small" if jax.default_backend() == "cpu" else "large")
  rows, extra = run(
    size, a.repeats, tuple(a.backend) if a.backend else BACKENDS, a.warmup, a.profile
  )
  table = markdown(rows, extra)
  print(
    f"rollout bench, size {size!r} on {jax.devices()[0].device_kind} (jax {jax.__version__})\n{table}"
  )
  if a.out:
    a.out.mkdir(parents=True, exist_ok=True)
    meta = dict(
      device=jax.devices()[0].device_kind,
      jax=jax.__version__,
      python=platform.python_version(),
      sglang_jax=_version("sglang-jax"),
      size=size,
      config=SIZES[size],
      repeats=a.repeats,
      warmup=a.warmup,
      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    (a.out / "results.json").write_text(
      json.dumps(dict(meta, rows=[dataclasses.asdict(r) for r in rows], **extra), indent=2)
    )
    (a.out / "summary.md").write_text(table + "\n")
  return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
