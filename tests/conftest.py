import os

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
