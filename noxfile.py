"""Sessions: ``nox -s tests`` (what CI runs), ``nox -s lint`` (ruff format + check, also in CI),
``nox -s bench`` (the main job), ``nox -s lower``, ``nox -s train`` (the GRPO loop on the embedded
default), ``nox -s parity`` (end-to-end parity of the loop's xla and pallas losses over seeds),
``nox -s profile`` (captured traces and their summaries), ``nox -s docs`` (the manual, built strictly
with its examples run), ``nox -s tensorboard -- <logdir>`` (a training
run's scalars or a captured profile), ``nox -s sglang`` (the sglang-jax rollout backend's tests and its
throughput vs our engines, Python 3.12), ``nox -s tpu_compile`` (every TPU kernel through libtpu's
compiler for each generation, alone and sharded; its own environment with jax[tpu]).

One environment for all of them: ``nox -s dev`` builds ``.nox/dev`` (the project with its ``dev``
extra: jax, pytest, matplotlib, tensorboard + its profile plugin, ruff), and every session above except
``lint`` and ``sglang`` requires it and runs in it, so jax is installed once, not once per session
(nox has no shared-venv option of its own). ``nox -R`` skips the reinstall into an existing one.
``lint`` keeps a small ruff-only venv (CI lints before anything else is installed); ``sglang`` needs
Python 3.12 and pins its own jax. Arguments after ``--`` go to the tool.
"""

import os
import pathlib

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
RUFF = "ruff==0.17.6"  # pinned: a new ruff release may reformat the tree
DEV = {}  # filled by the `dev` session, which every session using the shared env requires


@nox.session
def lint(session: nox.Session):
  """ruff: the formatter's check and the linter (rule set in pyproject.toml). `-- --fix` to apply."""
  session.install(RUFF)
  fix = "--fix" in session.posargs
  session.run("ruff", "format", *([] if fix else ["--check"]), ".")
  session.run("ruff", "check", *(["--fix"] if fix else []), ".")


@nox.session(default=False)
def dev(session: nox.Session):
  """The shared environment (.nox/dev): the project with its dev extra. Required by the sessions below."""
  session.install("-e", ".[dev]")
  bin_dir = pathlib.Path(session.bin)
  DEV.update(
    python=str(bin_dir / ("python.exe" if os.name == "nt" else "python")),
    env={
      "VIRTUAL_ENV": str(session.virtualenv.location),
      "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
    },
  )


def in_dev(session: nox.Session, *args: str, env: dict | None = None, **kwargs):
  """Run `python <args>` in the shared environment (from a session with `requires=["dev"]`), with
  ``env`` added to its variables."""
  if not DEV:
    session.error("the dev session did not run (every session using .nox/dev requires it)")
  return session.run(
    DEV["python"], *args, env={**DEV["env"], **(env or {})}, external=True, **kwargs
  )


def cpu_tests_env() -> dict:
  """The variables of the CPU test sessions (tests, docs' examples, sglang, tests_jax011): XLA CPU's
  LLVM at -O0. These runs compile thousands of small programs that then run for milliseconds, so code
  generation is most of their time: measured here, tests/rl/test_update.py with
  tests/kernels/grpo_loss/test_options.py (-n 2) took 143 s instead of 215 s. The option is the CPU
  backend's code optimisation, not its float semantics (fast math stays off), and each test compares
  programs built under the same flags. Not for tpu_compile (libtpu reads the same option), nor for
  tunix: its learner tests compare two sampled training runs step by step, and at -O0 two of them
  diverged (the agentic learner's third-step loss 0.0 against 0.060; a step-0 KL at float noise,
  -1e-7 against 6e-8, past its 1e-7 tolerance)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags:
    flags = f"{flags} --xla_backend_optimization_level=0".strip()
  return {"XLA_FLAGS": flags}


TEST_WORKERS = min(os.cpu_count() or 1, 4)
# A worker that dies (a segfault, or pytest-timeout ending a hung test) ends the run, its test reported
# failed by name. With restarts, pytest-xdist 3.8's loadfile scheduler re-queues the dead worker's
# finished files as empty work units and re-runs the test it died in, and the session can wait forever
# (pytest-dev/pytest-xdist#1323, #1327, #1378; reproduced here with a deliberately segfaulting test).
NO_WORKER_RESTART = ("--max-worker-restart", "0")
SHARED = dict(venv_backend="none", requires=["dev"])  # sessions that run in .nox/dev


@nox.session(**SHARED)
def tests(session: nox.Session):
  """Unit, parity, lowering and bench-smoke tests on CPU (interpret mode). Slow tests: -- -m slow."""
  # the `ci` hypothesis profile: 8 derandomized examples per property (tests/conftest.py)
  args = session.posargs or [
    "-m",
    "not slow and not gpu and not tpu",
    "--hypothesis-profile=ci",
    "--durations=25",  # the slowest tests in the CI log: where the 55-minute budget goes
    # One worker per core (at most 4: a worker peaks near 5 GB); a file stays on one worker, so its
    # module fixtures and jit caches are built once.
    *("-n", str(TEST_WORKERS), "--dist", "loadfile"),
    *NO_WORKER_RESTART,
  ]
  in_dev(
    session, "-m", "pytest", "-q", "--benchmark-disable", "-p", "no:cacheprovider", *args,
    env=cpu_tests_env(),
  )  # fmt: skip


@nox.session(**SHARED)
def bench(session: nox.Session):
  """Every kernel vs its reference on this backend; writes bench/results/<device kind>-<time>/."""
  in_dev(session, "-m", "bench", *session.posargs)


@nox.session(**SHARED)
def lower(session: nox.Session):
  """AOT-lower every kernel for TPU and CUDA at production shapes (no accelerator needed)."""
  in_dev(session, "-m", "pytest", "-q", "tests/kernels/test_lowering.py", *session.posargs)


@nox.session(**SHARED)
def train(session: nox.Session):
  """The GRPO loop on the embedded default (CPU, minutes): SFT warm-up, GRPO, eval_full. Overrides after --."""
  in_dev(session, "-m", "rl.train", "--config", "configs/cpu-default.yaml", *session.posargs)


@nox.session(**SHARED)
def docs(session: nox.Session):
  """The manual (docs/): Sphinx + MyST, strict (-W: a broken reference, an orphan page, a dead link, an
  undocumented public name or a failing example fails it), into docs/_build/html. Adds the docs extra
  to .nox/dev. Sphinx arguments after --, e.g. -- -b linkcheck."""
  in_dev(session, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-e", ".[docs]")
  args = session.posargs or ["-b", "html", "docs", "docs/_build/html"]
  in_dev(session, "-m", "sphinx", "-W", "--keep-going", *args, env=cpu_tests_env())


@nox.session(**SHARED)
def tensorboard(session: nox.Session):
  """TensorBoard on a log directory (`-- runs/<run>/tb` for a training run's scalars, `-- profiles/<run>`
  for a captured profile); further TensorBoard flags after it, e.g. `-- runs/x/tb --port 6007`."""
  if not session.posargs:
    session.error("give the log directory after --, e.g. nox -s tensorboard -- runs/cpu-default/tb")
  logdir, *flags = session.posargs
  in_dev(session, "-m", "tensorboard.main", "--logdir", logdir, *flags)


PARITY_DEFAULT = [
  "--config",
  "configs/cpu-default.yaml",
  "--seeds",
  "0",
  "1",
  "--arm",
  "xla: train.policy_loss_impl=xla",
  "--arm",
  "pallas: train.policy_loss_impl=pallas",
]


@nox.session(**SHARED)
def parity(session: nox.Session):
  """The GRPO loop per arm and seed, paired interval and verdict (CPU default: 4 runs of ~8 min).
  Own arms / seeds / config after --, e.g. -- --config configs/gpu-qwen2.5-0.5b.yaml --seeds 0 1 2 --arm ..."""
  in_dev(session, "-m", "bench.parity", *(session.posargs or PARITY_DEFAULT))


@nox.session(**SHARED)
def learning(session: nox.Session):
  """Does the embedded default learn? Its run over seeds 0 1 2: training reward first vs last 10 steps,
  eval_full before vs after GRPO in standard errors, reward_curve.png (mean and band over seeds).
  Own config / seeds / overrides after --, e.g. -- --config configs/cpu-default.yaml --seeds 0 1."""
  in_dev(
    session,
    "-m",
    "bench.loop.learning",
    *(session.posargs or ["--config", "configs/cpu-default.yaml", "--seeds", "0", "1", "2"]),
  )


@nox.session(**SHARED)
def loop(session: nox.Session):
  """The loop step-time regression benchmark (bench/history/loop.jsonl; args after -- to
  bench.loop.step_time)."""
  in_dev(session, "-m", "bench.loop.step_time", *session.posargs)


@nox.session(**SHARED)
def profile(session: nox.Session):
  """Traces into profiles/ (ignored by git): the bench (args after -- go to it) and 2 GRPO steps of the
  embedded loop, each summarised by bench.trace. Open them with `nox -s tensorboard -- profiles/<run>`."""
  platform = in_dev(session, "-c", "import jax; print(jax.default_backend())", silent=True).strip()
  # CPU: the interpreter's thread events would fill the trace export's 1M-event cap at the small size
  args = session.posargs or (["--size", "tiny"] if platform == "cpu" else [])
  in_dev(session, "-m", "bench", "--profile", "profiles/bench", *args)
  in_dev(session, "-m", "bench.trace", "profiles/bench")
  in_dev(
    session,
    "-m",
    "rl.train",
    "--config",
    "configs/cpu-default.yaml",
    "train.warmup_sft_steps=0",
    "train.steps=4",
    "eval.full_at_end=false",
    "run.out_dir=runs/profile-loop",
    "run.profile_steps=2",
    "run.profile_dir=profiles/loop",
  )
  in_dev(session, "-m", "bench.trace", "profiles/loop")


@nox.session(python="3.12")
def sglang(session: nox.Session):
  """The sglang_jax rollout backend (sglang-jax needs Python >= 3.12) on CPU: its tests, then tokens/s of
  sglang_jax vs paged vs dense on one workload (`bench.rollout.throughput --size h128`, parity-gated rows).

  One pytest process per engine: sglang-jax 0.1.0rc0's scheduler thread outlives `close()` and keeps a
  core busy, so each engine gets a process of its own (as the loop has). `-- --no-bench`: the tests
  alone (what .ci/run runs: the bench's parity gates are the log-prob tests' checks again, and its
  2 minutes are CI's budget); other arguments after -- go to pytest."""
  session.install("-e", ".[sglang]", "pytest>=8", "hypothesis>=6.100", "pytest-benchmark>=4")
  bench = "--no-bench" not in session.posargs
  pytest = (
    "pytest",
    "-q",
    "-p",
    "no:cacheprovider",
    "-W",
    "ignore::DeprecationWarning",
    *(a for a in session.posargs if a != "--no-bench"),
  )
  env = cpu_tests_env()
  for selection in ("qwen2-tied", "qwen3-untied", "not qwen2-tied and not qwen3-untied"):
    session.run(*pytest, "tests/rl/rollout/test_sglang_jax.py", "-k", selection, env=env)
  session.run(
    *pytest,
    "tests/rl/rollout/test_sglang_jax_logprobs.py",
    "tests/rl/rollout/test_sglang_jax_loop.py",
    env=env,
  )
  if not bench:
    return
  session.run(
    "python",
    "-W",
    "ignore::DeprecationWarning",
    "-m",
    "bench.rollout.throughput",
    "--size",
    "h128",
    "--backend",
    "paged",
    "--backend",
    "sglang_jax",
    "--backend",
    "dense",
    "--out",
    str(session.create_tmp()) + "/sglang-rollout",
  )


JAX_011 = ("jax>=0.11,<0.12", "jaxlib>=0.11,<0.12")


@nox.session(python="3.12")
def tests_jax011(session: nox.Session):
  """The default test selection under jax 0.11.x (it needs Python >= 3.12, so `tests` on 3.11 can only
  ever resolve jax 0.10): the version shims, and CUDA lowering on a GPU-less host via the abstract GPU."""
  session.install("-e", ".[dev]", *JAX_011)
  session.run(
    "python", "-c", "import jax; assert jax.__version__.startswith('0.11'), jax.__version__"
  )
  args = session.posargs or ["-m", "not slow and not gpu and not tpu"]
  session.run(
    "pytest", "-q", "--benchmark-disable", "-p", "no:cacheprovider", *args, env=cpu_tests_env()
  )  # fmt: skip


TUNIX_PINS = ("jax==0.10.2",)  # tunix 0.1.7 is tested here against jax 0.10.2


@nox.session
def tunix(session: nox.Session):
  """The tunix drop-in's tests (tests/integrations: parity with tunix's grpo_loss_fn and
  ppo_policy_loss_fn; tunix's own GRPOLearner, PPOLearner (actor + critic) and agentic GRPOLearner
  trained with its losses and ours; the compiled fused gradients) in their own environment:
  google-tunix brings its own flax / grain / qwix stack, kept out of .nox/dev. CPU only; ~360 CPU
  seconds, split over two xdist workers (about 3-4 minutes on 2 idle cores) after the install."""
  session.install("-e", ".[dev,tunix]", *TUNIX_PINS)
  args = session.posargs or ["-n", "2", "--dist", "loadfile", "tests/integrations"]
  session.run(
    "pytest", "-q", "--benchmark-disable", "-p", "no:cacheprovider", *args,
    env={"JAX_PLATFORMS": "cpu"},
  )  # fmt: skip


# pytest, xdist (two workers) and hypothesis, which tests/conftest.py imports; matplotlib for the
# compiled report's plots (python -m bench --target tpu-... in this environment)
TPU_COMPILE_DEPS = (
  "pytest>=8",
  "pytest-xdist>=3.5",
  "pytest-timeout>=2.4",
  "hypothesis>=6.100",
  "matplotlib",
)


TPU_COMPILE_TESTS = (
  "tests/bench/tpu/test_compile.py",
  "tests/rl/aot/test_tpu_check.py",
  "tests/kernels/optim/test_pallas_tpu.py",
  "tests/kernels/test_tpu_targets.py",
  "tests/bench/tpu/test_schedule.py",
  "tests/bench/tpu/test_compiled_report.py",  # a compiled report's every row at or above its floors
  "tests/bench/tpu/test_fused_linear_gap_cost.py",  # the fused head's support gap <= 1.10x (v6e)
)


@nox.session(python="3.11", default=False)
def tpu_compile(session: nox.Session):
  """Every TPU kernel and TPU config through libtpu's real compiler, no TPU needed:
  tests/bench/tpu/test_compile.py compiles each case of bench/tpu/compile.py for v4, v5e, v5p, v6e and v7x,
  inside sharded programs on a 4-chip v6e slice, and the autotuner's TPU candidates;
  tests/rl/aot/test_tpu_check.py runs `--check` on every configs/tpu-*.yaml's slice (reduced-layer
  twins); the TPU optimizer's, the slice table's and the scheduled code's compile tests. Its own
  environment: the project + jax[tpu] at the version the project resolved (jax 0.10.x on 3.11;
  libtpu's compiler must match jaxlib). Pytest arguments after --."""
  _tpu_compile(session, (), TPU_COMPILE_TESTS)


# What differs for TPU between jax versions is the kernels' lowering (Pallas -> Mosaic) and the libtpu
# compiler behind it: every kernel case on every generation, alone and sharded, the tuner's
# candidates, the optimizer's kernels and the scheduled code. The configs' --check and the optimizer
# over a whole 0.5B tree (XLA programs around the same kernels) stay in `tpu_compile`, so the two
# sessions fit .ci/run's 55 minutes.
TPU_COMPILE_JAX011_TESTS = (
  *(t for t in TPU_COMPILE_TESTS if t != "tests/rl/aot/test_tpu_check.py"),
  *("-k", "not full_0_5b_tree"),
)


@nox.session(python="3.12", default=False)
def tpu_compile_jax011(session: nox.Session):
  """`tpu_compile`'s kernel compiles under jax 0.11.x and its libtpu (0.0.48.1 with jax 0.11.2;
  Python >= 3.12), in their own environment."""
  _tpu_compile(session, JAX_011, TPU_COMPILE_JAX011_TESTS)


def _tpu_compile(session: nox.Session, pins: tuple[str, ...], tests: tuple[str, ...]):
  session.install("-e", ".", *TPU_COMPILE_DEPS, *pins)
  # run_install: it runs under --install-only (CI installs this environment in the background) and is
  # skipped under -R, where the environment already has its libtpu
  version = session.run_install("python", "-c", "import jax; print(jax.__version__)", silent=True)
  if version:
    session.install(f"jax[tpu]=={version.strip()}")
  # a CPU host: jax's own backend stays CPU while libtpu compiles for abstract TPU devices; the lock
  # file would otherwise let one process on the machine load libtpu (xdist runs two)
  session.env["JAX_PLATFORMS"] = "cpu"
  session.env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  args = session.posargs or [
    *("-n", str(min(os.cpu_count() or 1, 2)), "--dist", "worksteal", "--max-worker-restart", "0"),
    "--durations=10",
    *tests,
  ]
  session.run("pytest", "-q", "-p", "no:cacheprovider", *args)


@nox.session(venv_backend="none")
def device(session: nox.Session):
  """On a lent GPU, one call per command: `nox -s device -- --call kernels|tune|loop [--out DIR]`
  (`python -m bench.device`: each call <= 9 minutes, one archive + summary). No virtualenv: it runs on
  the machine's preinstalled jax (the GPU image has no package index)."""
  session.env["PYTHONPATH"] = "."
  args = session.posargs or ["--call", "kernels"]
  session.run("python", "-m", "bench.device", *args, external=True)
