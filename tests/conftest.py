import atexit
import gc
import importlib.util
import os
import shutil
import sys
import tempfile

# 8 simulated CPU devices for the sharded tests; must be set before jax initialises its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

# One jax compilation cache per test run, shared by the xdist workers and the processes the tests start
# (they inherit the variables): a program compiled again in the run (a jit rebuilt per call, one config
# run by several tests, a parity run's second seed, a resumed run, a test after the mapping release
# below) is read back instead of compiled. It starts empty, so a run still compiles each program once,
# and goes with the run. With a size limit jax's cache takes a file lock around every read and write:
# without one, a worker could read an entry the other is still writing. `nox -s tpu_compile` turns it
# off (JAX_ENABLE_COMPILATION_CACHE=false): its programs are compiled for abstract TPU devices.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="jax-compile-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  if importlib.util.find_spec("filelock") is not None:
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import hypothesis
import jax  # after XLA_FLAGS above: jax reads them when its backend starts
import pytest

# Interpret-mode kernels compile per shape: keep hypothesis runs few and deadline-free.
hypothesis.settings.register_profile(
  "default",
  max_examples=8,
  deadline=None,
  print_blob=True,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
# CI (`pytest --hypothesis-profile=ci`): 8 examples per property (30, then 15, took CI past its
# 55-minute budget), derandomized so that a run is reproducible from the commit alone (the same
# examples every time: more of them would not search further from run to run); the kernel tests keep
# shapes tiny. `thorough` (60, random) for a deeper search by hand.
hypothesis.settings.register_profile(
  "ci",
  max_examples=8,
  deadline=None,
  derandomize=True,
  database=None,
  print_blob=True,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile("thorough", max_examples=60, deadline=None, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# XLA CPU maps each compiled program's code as memory mappings (about 3 for a small program, more for
# a larger one) and keeps them while a jit cache holds the program. An
# xdist worker runs hundreds of test files in one process; past the kernel's vm.max_map_count (65530
# by default) LLVM's next mmap fails and the worker dies ("LLVM compilation error: Cannot allocate
# memory", then a segfault or abort): CI run 54's crash in tests/rl/test_train.py after 23 minutes.
# tests/rl/test_update.py alone maps 15000 within a minute and a half. So after any test that leaves
# the process above MAX_MAPPINGS, every compiled program is released (jit caches cleared).
MAX_MAPPINGS = 24576


def mappings() -> int:
  """This process's memory mappings (0 where /proc is not there)."""
  if not sys.platform.startswith("linux"):
    return 0
  with open("/proc/self/maps", "rb") as maps:
    return sum(1 for _ in maps)


def release_compiled_programs() -> None:
  """Drop every jit / pjit cache and collect: the compiled programs of finished tests go."""
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True)
def _release_compiled_programs_past_the_mapping_budget():
  yield
  if mappings() > MAX_MAPPINGS:
    release_compiled_programs()
