"""Ahead of time, nothing allocated: the run's compiled programs at the config's shapes from
abstract inputs (rl.aot.programs), `--check` — is a config valid for its platform: loss impl,
memory, compiles (rl.aot.check), on a TPU slice's abstract devices (rl.aot.slice_check) — and the
decode step's bytes on one TPU chip from XLA's cost analysis (rl.aot.decode_bytes)."""
