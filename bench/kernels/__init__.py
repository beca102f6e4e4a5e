"""The kernel suites of `python -m bench`: each op's cases, kernel beside its pure-JAX reference and
peers (bench.kernels.cases), one case compiled, parity-checked and timed (bench.kernels.run) through
the timing harness (bench.kernels.harness: compile once, warm up, median of repeats), and the device
ceilings its roofline fractions are taken against (bench.kernels.roofline)."""
