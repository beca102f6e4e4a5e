"""The rollout engines' bench: tokens/s of each backend on the same workloads
(`python -m bench.rollout.throughput`, the `rollout` suite of `python -m bench`), its parity gates
(bench.rollout.parity) and markdown table (bench.rollout.table), the compiled byte account of a
decode step (`python -m bench.rollout.byte_account`) and the paged engine's bf16 precision study
(`python -m bench.rollout.paged_precision`)."""
