"""The rollout suite's markdown table (bench.rollout's rows): measured times beside the compiled byte
account and the parity gates, one row per workload and backend."""

from __future__ import annotations


def markdown(rows: list, extra: dict | None = None) -> str:  # rows: bench.rollout.RolloutBenchRow
  """The suite's table. Time columns and "time vs dense" are measured; the byte columns and "bytes vs
  dense" come from XLA's cost analysis of the compiled decode step (bench.byte_account), not measured;
  "gate" is the f32 + highest parity run (ok), "own dtype" the timed run's report-only divergence."""
  ref = (extra or {}).get("reference", "dense")
  lines = [
    "| workload | backend | median s | tokens | tokens/s | prefill s | decode s | decode steps | "
    "time vs dense (measured) | step ms (measured) | bytes/step ideal GB | accessed GB | ratio | "
    "bytes vs dense (compiled) | gate: f32 highest err/tol (nats) | "
    f"own dtype: nats (ulps of max logit; err/tol) | greedy = {ref} | ok |",
    "|" + "---|" * 18,
  ]
  dense = {r.workload: r for r in rows if r.backend == "dense"}
  agree = (extra or {}).get("greedy_agreement", {})
  # a result from before a column existed has NaN there: shown as "-"; its step time is derived from
  # the measured decode time and steps
  num = lambda x, fmt, unit="": "-" if x != x else f"{x:{fmt}}{unit}"
  for r in rows:
    d = dense.get(r.workload)
    speed = num(r.tokens_per_s / d.tokens_per_s, ".2f", "x") if d else "-"
    # accessed bytes per generated token: the engines' steps differ in count and shape
    per_tok = lambda x: x.bytes_accessed * x.decode_steps / max(x.tokens, 1)
    bytes_vs = num(per_tok(r) / per_tok(d), ".2f", "x") if d and per_tok(d) else "-"
    same = agree.get(r.workload, {}).get(r.backend)
    step_ms = r.step_ms if r.step_ms == r.step_ms else 1e3 * r.decode_s / max(r.decode_steps, 1)
    lines.append(
      f"| {r.workload} | {r.backend} | {r.median_s:.3f} | {r.tokens} | {r.tokens_per_s:.1f} | "
      f"{r.prefill_s:.3f} | {r.decode_s:.3f} | {r.decode_steps} | {speed} | {step_ms:.2f} | "
      f"{num(r.bytes_ideal / 1e9, '.3g')} | {num(r.bytes_accessed / 1e9, '.3g')} | "
      f"{num(r.bytes_ratio, '.2f', 'x')} | {bytes_vs} | "
      f"{num(r.gate_parity, '.2g')} ({num(r.gate_max_abs_diff, '.2g')}) | "
      f"{r.logprob_max_abs_diff:.2g} ({num(r.rounding_ulps, '.2g')}; {r.logprob_parity:.2g}) | "
      f"{'-' if same is None else f'{100 * same:.0f}%'} | {'yes' if r.ok else 'NO'} |"
    )
  return "\n".join(lines)
