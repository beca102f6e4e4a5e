"""Counting XLA work: `with compile_events() as events:` lists the trace / lower / compile events jax
reports inside the block. A no-recompile test asserts it stays empty; this is robust where a jitted
function's C++ cache size is not (it read 0 after other modules had run in the same process).
`with compiled_functions() as names:` lists the name of each function XLA compiled in the block (one
entry per backend compile), for tests that allow some compiles and forbid others."""

import contextlib
import os

import jax

from rl.logging.metrics import COMPILE_EVENT


@contextlib.contextmanager
def compile_events():
  events: list[str] = []
  listener = lambda event, *_, **__: events.append(event) if "compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@contextlib.contextmanager
def compiled_functions():
  names: list[str] = []

  def listener(event, _duration, fun_name="?", **__):
    if event == COMPILE_EVENT:
      names.append(str(fun_name))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def one_device_xla_flags() -> str:
  """This process's XLA_FLAGS without the forced host device count (tests/conftest.py's 8), for a
  test's subprocess that runs as one CPU device: the session's other flags (nox's -O0) stay."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  return " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count"))
