"""The RL loop's benchmarks: its step time as a regression history
(`python -m bench.loop.step_time`, `nox -s loop`), whether it learns over seeds
(`python -m bench.loop.learning`, `nox -s learning`; the paired arms of `python -m bench.parity`
build on it), the memory of one update (`python -m bench.loop.memory`), the compile time of its two
big programs (`python -m bench.loop.compile_time`) and tunix's GRPO step with its loss and ours
(`python -m bench.loop.tunix_memory`)."""
