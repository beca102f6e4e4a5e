"""The benchmark harness and the evidence tools: `python -m bench` (every kernel against its reference
and peers: parity first, then timing, roofline fractions, memory, reports and figures), compiled TPU
reports (`--target`), the loop's parity / learning / step-time benches, the rollout and mismatch
suites, traces, the autotuner and the GPU device plan. The manual: docs/benchmarks.md.
"""
