import gc
import os
import sys

# 8 simulated CPU devices for the sharded tests; must be set before jax initialises its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

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
# the process above MAX_MAPPINGS, every compiled program is released (jit caches cleared). 24576
# leaves 40000 below the default limit, over twice what test_update.py adds; at 16384 the releases
# cost a local full run about 3.5 minutes of recompiling.
MAX_MAPPINGS = 24576

# No persistent compilation cache (jax_compilation_cache_dir) for test runs. With one shared by a run's
# processes (jax 0.10.2, CPU) the rl tests took as long (tests/rl/test_train.py, test_update.py and
# agent/test_env_agent.py, -n 2: 353 s either way), and tunix's agentic GRPO learner test logged a
# loss of 0.0 at its third step instead of 0.060 (tests/integrations/test_tunix_agentic_learner.py;
# it passes without the cache). That test compares two sampled training runs step by step and
# diverged the same way when only XLA's optimisation level changed, so the cache may not be at fault;
# with no time to gain, it stays off.


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
