"""Device peaks (HBM bandwidth, matmul flops) and roofline fractions.

Datasheet values are the fallback; a bandwidth measured on the device in the same run (a large
on-device copy, see :func:`measure_bandwidth`) is preferred when the harness has one.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
  hbm_bytes_per_s: float | None  # memory bandwidth
  bf16_flops_per_s: float | None  # dense matmul peak
  source: str  # "datasheet" or "measured"


# Keyed by a prefix of jax's ``device.device_kind``. Dense (non-sparse) peaks from vendor datasheets.
DATASHEET: dict[str, DevicePeaks] = {
  "NVIDIA H100 80GB HBM3": DevicePeaks(3.35e12, 989e12, "datasheet"),  # SXM
  "NVIDIA H100 PCIe": DevicePeaks(2.0e12, 756e12, "datasheet"),
  "NVIDIA H100": DevicePeaks(3.35e12, 989e12, "datasheet"),
  "NVIDIA H200": DevicePeaks(4.8e12, 989e12, "datasheet"),
  "NVIDIA A100-SXM4-80GB": DevicePeaks(2.04e12, 312e12, "datasheet"),
  "NVIDIA A100": DevicePeaks(1.56e12, 312e12, "datasheet"),
  "TPU v4": DevicePeaks(1.2e12, 275e12, "datasheet"),
  "TPU v5 lite": DevicePeaks(8.19e11, 197e12, "datasheet"),  # v5e
  "TPU v5p": DevicePeaks(2.765e12, 459e12, "datasheet"),
  "TPU v5": DevicePeaks(2.765e12, 459e12, "datasheet"),
  "TPU v6 lite": DevicePeaks(1.64e12, 918e12, "datasheet"),  # v6e / Trillium
}


def datasheet_peaks(device_kind: str) -> DevicePeaks | None:
  for prefix in sorted(DATASHEET, key=len, reverse=True):
    if device_kind.startswith(prefix):
      return DATASHEET[prefix]
  return None


def measure_bandwidth(device=None, nbytes: int = 1 << 28, repeats: int = 10) -> float:
  """Bytes/s of a read-once write-once elementwise pass over ``nbytes`` on ``device`` (median)."""
  device = device or jax.devices()[0]
  n = nbytes // 4
  x = jax.device_put(jnp.ones((n,), jnp.float32), device)
  step = jax.jit(lambda a: a * 1.0001 + 1.0).lower(x).compile()
  jax.block_until_ready(step(x))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(step(x))
    times.append(time.perf_counter() - t0)
  times.sort()
  return 2 * n * 4 / times[len(times) // 2]


def peaks_for(device=None, *, measure: bool = True) -> DevicePeaks:
  """Measured bandwidth when ``measure`` (datasheet flops alongside), else the datasheet entry."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    # A single-stream copy probe understates what XLA's concurrent CPU fusions reach (fractions above
    # 100% were seen), and CPU runs are not kernel performance anyway: report no roofline there.
    return DevicePeaks(None, None, "none on CPU")
  sheet = datasheet_peaks(device.device_kind)
  if not measure:
    return sheet or DevicePeaks(None, None, "unknown")
  bw = measure_bandwidth(device, nbytes=1 << 30)
  return DevicePeaks(bw, sheet.bf16_flops_per_s if sheet else None, "measured")


def roofline_fraction(
  seconds: float, nbytes: float | None, flops: float | None, peaks: DevicePeaks
) -> float | None:
  """Achieved fraction of the binding roofline: max(bytes / bandwidth, flops / peak) / time."""
  bounds = []
  if nbytes and peaks.hbm_bytes_per_s:
    bounds.append(nbytes / peaks.hbm_bytes_per_s)
  if flops and peaks.bf16_flops_per_s:
    bounds.append(flops / peaks.bf16_flops_per_s)
  return max(bounds) / seconds if bounds and seconds > 0 else None
