"""TPU evidence from libtpu's compiler on a host without a TPU: every kernel case compiled per
generation, alone and in sharded programs (`python -m bench.tpu.compile`, `nox -s tpu_compile`), the
compiled report of the bench's cases with modelled times (`python -m bench --target tpu-v6e`, run
through `python -m bench.tpu.compiled`) and the reading of libtpu's scheduled code: bundles per grid
step and spills (bench.tpu.schedule)."""
