import atexit
import os
import shutil
import tempfile

# One jax compilation cache per test run, shared by the xdist workers and by the processes the tests
# start (the variable is inherited): a program compiled again elsewhere in the run (a jit rebuilt per
# call, one config run by several tests, a parity run's second seed, a resumed run) is read back, not
# compiled again. It starts empty, so every run still compiles each program once (CI times a cold
# run), and goes with the run. A cache hit still reports jax's compile event (tests/compiles.py).
# Measured on the shared 2-core machine: test_grpo_loss.py's parametrized parity tests and
# test_kl_estimators.py (61 tests, -n 2) 309 s -> 194 s, their reference programs compiled once
# instead of once per kernel family. Programs under 0.2 s to compile are not written.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="jax-compile-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# 8 simulated CPU devices for the sharded tests; must be set before jax initialises its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import hypothesis

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
