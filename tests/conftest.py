import os
import hypothesis

# Interpret-mode kernels compile per shape: keep hypothesis runs few and deadline-free.
hypothesis.settings.register_profile("default", max_examples=8, deadline=None, print_blob=True,
                                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.register_profile("thorough", max_examples=60, deadline=None, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
