"""Sessions: ``nox -s tests`` (what CI runs), ``nox -s bench`` (the main job), ``nox -s lower``,
``nox -s train`` (the GRPO loop on the embedded default).

Each session installs the project with its dev extras into its own virtualenv, so both commands work
on a fresh machine with only Python >= 3.11 and nox. Arguments after ``--`` go to the tool.
"""

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True



@nox.session
def tests(session: nox.Session):
  """Unit, parity, lowering and bench-smoke tests on CPU (interpret mode). Slow tests: -- -m slow."""
  session.install("-e", ".[dev]")
  args = session.posargs or ["-m", "not slow and not gpu and not tpu"]
  session.run("pytest", "-q", "--benchmark-disable", "-p", "no:cacheprovider", *args)


@nox.session
def bench(session: nox.Session):
  """Every kernel vs its reference on this backend; writes bench/results/<device>-<time>/."""
  session.install("-e", ".[dev]")
  session.run("python", "-m", "bench", *session.posargs)


@nox.session
def lower(session: nox.Session):
  """AOT-lower every kernel for TPU and CUDA at production shapes (no accelerator needed)."""
  session.install("-e", ".[dev]")
  session.run("pytest", "-q", "tests/test_lowering.py", *session.posargs)


@nox.session
def train(session: nox.Session):
  """The GRPO loop on the embedded default (CPU, minutes): SFT warm-up, GRPO, eval_full. Overrides after --."""
  session.install("-e", ".")
  session.run("python", "-m", "rl.train", "--config", "configs/cpu-default.yaml", *session.posargs)
