import pytest

from kernels import backend


def test_resolve_prefers_argument_then_context_then_host():
  assert backend.resolve("tpu") == backend.Target("tpu", False)
  assert backend.resolve("gpu", interpret=True) == backend.Target("gpu", True)
  with backend.use_target("tpu"):
    assert backend.resolve() == backend.Target("tpu", False)
    assert backend.resolve("cpu") == backend.Target("cpu", True)
    assert backend.resolve(interpret=True) == backend.Target("tpu", True)
  assert backend.resolve().platform == backend.host_platform()


def test_targets_and_families():
  assert backend.Target("cpu", True).family == "tiled"
  assert backend.Target("tpu").family == "tiled"
  assert backend.Target("gpu").family == "rowloop"
  assert backend.Target("gpu").lowering_platform == "cuda"
  with pytest.raises(ValueError, match="interpret mode"):
    backend.Target("cpu", False)
  with pytest.raises(ValueError, match="platform must be one of"):
    backend.Target("rocm")


def test_compiler_params_per_backend():
  assert backend.compiler_params(backend.Target("cpu", True)) is None
  tpu = backend.compiler_params(
    backend.Target("tpu"), dimension_semantics=("parallel", "arbitrary")
  )
  assert tuple(tpu.dimension_semantics) == ("parallel", "arbitrary")
  gpu = backend.compiler_params(backend.Target("gpu"), num_warps=4, num_stages=2)
  assert (gpu.num_warps, gpu.num_stages) == (4, 2)
