"""The test run's guard against running out of memory mappings (tests/conftest.py)."""

import sys

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import mappings, release_compiled_programs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_releasing_compiled_programs_unmaps_their_code():
  """Catches a jax whose clear_caches no longer frees executables, or a release_compiled_programs that
  no longer clears them: the guard would then run and free nothing, and a worker's mappings would grow
  with every test until vm.max_map_count kills it."""
  release_compiled_programs()
  before = mappings()
  programs = [jax.jit(lambda x, k=k: jnp.sin(x) * k) for k in range(200)]
  for program in programs:
    program(jnp.ones(3)).block_until_ready()
  assert mappings() - before >= 200  # each program maps its code (about 3 mappings each)
  release_compiled_programs()
  assert mappings() - before < 100, "compiled programs kept their code mapped"
