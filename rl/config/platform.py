"""Which platform a config targets, and what `train.policy_loss_impl` means there: the loss ops' tables.

`policy_loss_impl=pallas` means "this project's kernel on this platform": the Triton loss on GPU, the
tiled kernel on TPU, the Pallas interpreter on CPU; with `fused_lm_head=true` the best fused LM-head
path the platform has (GPU: kernels.fused_linear's own "pallas", which there is the Mosaic GPU fused
kernel for bf16 / f16 activations and the chunked path for f32; "chunked" stays selectable). A choice a platform
lacks is a ConfigError when the config is loaded, naming the choices it has — never an error from
inside the first compile (issue 31: fused pallas on GPU failed a minute into compiling the update).
"""

from __future__ import annotations

import os

from kernels.backend import Platform, host_platform
from kernels.fused_linear import OP as FUSED_LOSS_OP
from kernels.grpo_loss import OP as LOSS_OP
from rl.configlib import ConfigError

PLATFORMS: tuple[Platform, ...] = ("cpu", "gpu", "tpu")

# (platform, train.fused_lm_head) -> {train.policy_loss_impl: the impl passed to the kernel entry
# point (kernels.grpo_loss, or kernels.fused_linear_grpo_loss when fused)}: "auto" (the kernels' own
# per-platform default) and every impl the op's table offers on the platform (kernels.ops.Impl's
# platforms). A missing key: the platform lacks that choice.
LOSS_IMPLS: dict[tuple[Platform, bool], dict[str, str]] = {
  (platform, fused): {impl: impl for impl in ("auto", *op.on(platform))}
  for platform in PLATFORMS
  for fused, op in ((False, LOSS_OP), (True, FUSED_LOSS_OP))
}
# Every value train.policy_loss_impl may take somewhere (the config's Literal is built from it).
CHOICES = tuple(sorted({k for row in LOSS_IMPLS.values() for k in row}))


def loss_impl(platform: Platform, fused_lm_head: bool, impl: str) -> str:
  """The kernel impl of `train.policy_loss_impl=impl` on `platform`; a ConfigError naming the
  alternatives when the platform lacks it."""
  row = LOSS_IMPLS[(platform, fused_lm_head)]
  if impl not in row:
    head = "with" if fused_lm_head else "without"
    raise ConfigError(
      f"train.policy_loss_impl={impl} is not available on {platform} {head} "
      f"train.fused_lm_head: choose one of {sorted(row)}"
    )
  return row[impl]


def config_platform(path: str | os.PathLike | None) -> Platform:
  """The platform a config file targets, from its name (configs/gpu-*.yaml: gpu, tpu-*: tpu,
  cpu-*: cpu); any other name (or none): the platform this process runs on."""
  name = os.path.basename(str(path or ""))
  for platform in PLATFORMS:
    if name.startswith(platform + "-"):
      return platform
  return host_platform()
