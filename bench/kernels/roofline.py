"""Device ceilings (HBM bandwidth, bf16 matmul flops) and roofline fractions.

Both ceilings are measured the way other tools reach them, and reported beside the datasheet: HBM
bandwidth as a device-to-device copy of >= 2 GiB (read + write), many copies issued back to back and
timed together; the bf16 ceiling as a square matmul issued the same way. Each is taken over several
rounds: the best round is the ceiling the fractions use, the median is reported beside it. (The earlier
probe, one elementwise pass of 1 GiB timed call by call, read 2.32 TB/s on an H100 SXM whose copies
reach ~3.0 TB/s, inflating every fraction by ~1.3x.)
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
  hbm_bytes_per_s: float | None  # memory bandwidth the fractions use (measured best, or datasheet)
  bf16_flops_per_s: float | None  # dense matmul ceiling the fractions use
  source: str  # "datasheet", "measured" or why there is none
  hbm_median_bytes_per_s: float | None = None  # measured: the median round
  bf16_median_flops_per_s: float | None = None
  datasheet_hbm_bytes_per_s: float | None = None  # beside the measured ones in the report
  datasheet_bf16_flops_per_s: float | None = None


@dataclasses.dataclass(frozen=True)
class CeilingConfig:
  """Sizes of the ceiling probes (small ones make them testable on CPU)."""

  copy_bytes: int = 2 << 30  # >= 2 GiB on an accelerator: far past every cache
  matmul_n: int = 8192  # [n, n] @ [n, n] bf16
  iters: int = 20  # back-to-back calls per timed round
  rounds: int = 5

  def __post_init__(self):
    if self.copy_bytes < 1024 or self.matmul_n < 8 or self.iters < 1 or self.rounds < 1:
      raise ValueError(
        "CeilingConfig: copy_bytes >= 1024, matmul_n >= 8, iters >= 1 and rounds >= 1 "
        f"(got {self.copy_bytes}, {self.matmul_n}, {self.iters}, {self.rounds})"
      )


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


def _rounds(fn, arg, iters: int, rounds: int) -> list[float]:
  """Seconds per call over ``rounds`` rounds of ``iters`` calls issued back to back, each round
  timed as a whole (dispatch overlaps execution, as in a real step)."""
  jax.block_until_ready(fn(arg))  # compile and warm up
  per_call = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(arg)  # the previous output is dropped: at most two buffers live
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - t0) / iters)
  return per_call


def measure_copy_bandwidth(
  device=None, cfg: CeilingConfig = CeilingConfig()
) -> tuple[float, float]:
  """(best, median) bytes/s of a device-to-device copy of ``cfg.copy_bytes`` (read + write)."""
  device = device or jax.devices()[0]
  n = cfg.copy_bytes // 4
  x = jax.device_put(jnp.zeros((n,), jnp.float32), device)  # [n]
  copy = jax.jit(lambda a: jnp.copy(a))  # a fresh output buffer: XLA must move every byte
  times = _rounds(copy, x, cfg.iters, cfg.rounds)
  moved = 2 * n * 4
  return moved / min(times), moved / statistics.median(times)


def measure_matmul_flops(device=None, cfg: CeilingConfig = CeilingConfig()) -> tuple[float, float]:
  """(best, median) flop/s of a bf16 [n, n] @ [n, n] matmul with f32 accumulation."""
  device = device or jax.devices()[0]
  n = cfg.matmul_n
  a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16), device)  # [n, n]
  mm = jax.jit(lambda m: jnp.dot(m, m, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  times = _rounds(mm, a, cfg.iters, cfg.rounds)
  flops = 2 * n**3
  return flops / min(times), flops / statistics.median(times)


def measure_bandwidth(device=None, nbytes: int = 2 << 30, repeats: int = 20) -> float:
  """Best copy bandwidth (bytes/s) over ``nbytes`` (kept for callers of the old probe)."""
  return measure_copy_bandwidth(device, CeilingConfig(copy_bytes=nbytes, iters=repeats))[0]


def measured_peaks(device=None, cfg: CeilingConfig = CeilingConfig()) -> DevicePeaks:
  """Both ceilings measured on ``device``, the datasheet's beside them (any backend: on CPU with a
  small ``cfg`` this is what the tests run; the bench itself reports no roofline on CPU)."""
  device = device or jax.devices()[0]
  sheet = datasheet_peaks(device.device_kind)
  bw, bw_median = measure_copy_bandwidth(device, cfg)
  fl, fl_median = measure_matmul_flops(device, cfg)
  return DevicePeaks(
    bw,
    fl,
    "measured",
    bw_median,
    fl_median,
    sheet.hbm_bytes_per_s if sheet else None,
    sheet.bf16_flops_per_s if sheet else None,
  )


def peaks_for(
  device=None, *, measure: bool = True, cfg: CeilingConfig = CeilingConfig()
) -> DevicePeaks:
  """Measured ceilings when ``measure`` (datasheet beside them), else the datasheet entry."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    # CPU runs are not kernel performance (the Pallas interpreter): report no roofline there.
    return DevicePeaks(None, None, "none on CPU")
  sheet = datasheet_peaks(device.device_kind)
  if not measure:
    return sheet or DevicePeaks(None, None, "unknown")
  return measured_peaks(device, cfg)


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
