"""The benchmarks. `python -m bench` (bench.__main__, its command line bench.cli, its report
bench.report with figures bench.plots) runs every suite; the kernel suites live in bench/kernels
(cases, timing harness, roofline), the rollout engines' in bench/rollout, the RL loop's in
bench/loop, the TPU compile evidence in bench/tpu and the lent-accelerator calls in bench/device.
Commands of their own: bench.tune (the autotuner), bench.parity (paired loop runs over seeds),
bench.mismatch (the engines' log-prob mismatch), bench.trace (profiler traces). Shared with the
tests: the problem shapes (bench.shapes) and the one tolerance table (bench.tolerances). The manual:
docs/benchmarks.md.
"""
