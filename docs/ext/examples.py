"""Every code block in docs/ and README.md runs when the manual is built, unless it says why not.

A fenced block is run by its language:

* ``python``: executed, the blocks of one page in order in one namespace (a page reads like a
  session), every page in a fresh one, all in one subprocess on CPU (``JAX_PLATFORMS=cpu``);
* ``bash`` / ``sh`` / ``shell`` / ``console``: run by ``bash -euo pipefail`` from the repository root;
* ``yaml``: read as a configuration and built into ``rl.config.GRPOConfig`` (every key and value
  checked, as ``python -m rl.train`` would);
* anything else (``text``: formulas, output, tables of a format) is not code and is only counted.

A block that cannot run here is marked on the line before it, with its reason::

    <!-- skip: needs a TPU -->

The build prints how many blocks ran and how many were skipped, grouped by reason; a block that
fails is a warning naming its file and line (an error under ``-W``). ``python docs/ext/examples.py
[FILE.md ...]`` runs the same check without Sphinx (on the named pages only, if given).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import traceback

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>[^`]*)$")
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.+?)\s*-->\s*$")
PYTHON, SHELL, YAML = (
  {"python", "py", "python3"},
  {"bash", "sh", "shell", "console"},
  {"yaml", "yml"},
)
SKIP_DIRS = {"_build", "_generated", "api", "ext"}
TIMEOUT_S = 600


@dataclasses.dataclass
class Block:
  path: str
  line: int  # of the opening fence, 1-based
  lang: str
  code: str
  skip: str | None = None

  @property
  def where(self) -> str:
    return f"{self.path}:{self.line}"


def blocks_of(path: pathlib.Path, root: pathlib.Path) -> list[Block]:
  """The fenced blocks of a Markdown file (MyST directives such as ```{toctree} are not code)."""
  lines = path.read_text().splitlines()
  found, i = [], 0
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    fence, info = m.group("fence"), m.group("info").strip()
    end = next(
      (j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines)
    )
    lang = info.split()[0].lower() if info else ""
    if not lang.startswith("{"):
      prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
      skip = SKIP.match(prev)
      indent = len(m.group("indent"))
      code = "\n".join(line[indent:] for line in lines[i + 1 : end])
      rel = path.relative_to(root).as_posix()
      found.append(Block(rel, i + 1, lang, code, skip.group("reason") if skip else None))
    i = end + 1
  return found


def sources(root: pathlib.Path) -> list[pathlib.Path]:
  docs = root / "docs"
  pages = [p for p in docs.rglob("*.md") if not SKIP_DIRS & set(p.relative_to(docs).parts)]
  return [root / "README.md", *sorted(pages)]


def run_python_pages(pages: dict[str, list[Block]], root: pathlib.Path) -> dict[str, str | None]:
  """Runs every page's python blocks in one subprocess; {where: error or None}."""
  payload = {p: [dataclasses.asdict(b) for b in bs] for p, bs in pages.items()}
  with tempfile.TemporaryDirectory() as tmp:
    spec = pathlib.Path(tmp) / "blocks.json"
    spec.write_text(json.dumps(payload))
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
      [sys.executable, __file__, "--python-worker", str(spec)],
      cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    out = pathlib.Path(tmp) / "blocks.json.out"
    if not out.exists():
      err = f"the python worker exited with {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
      return {b.where: err for bs in pages.values() for b in bs}
    return json.loads(out.read_text())


def python_worker(spec: pathlib.Path) -> None:
  """(subprocess) Executes each page's blocks in order in one namespace; writes {where: error}."""
  import types

  results = {}
  for i, blocks in enumerate(json.loads(spec.read_text()).values()):
    module = types.ModuleType(f"docs_example_{i}")  # a real module: dataclasses look classes up
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    for b in map(lambda d: Block(**d), blocks):
      try:
        exec(compile(b.code, b.where, "exec"), namespace)  # the docs' own examples
        results[b.where] = None
      except BaseException:  # a block's failure is reported, the others still run
        results[b.where] = traceback.format_exc(limit=-4)
  pathlib.Path(str(spec) + ".out").write_text(json.dumps(results))


def run_shell(block: Block, root: pathlib.Path) -> str | None:
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
  )
  # `python` in a block is the interpreter building the manual (the project's environment)
  env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
  with tempfile.TemporaryDirectory() as tmp:
    env["TMP_OUT"] = tmp  # a scratch directory a block may write its outputs to
    proc = subprocess.run(
      ["bash", "-euo", "pipefail", "-c", block.code], cwd=root, env=env,
      capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
  return (
    None
    if proc.returncode == 0
    else f"exit {proc.returncode}:\n{proc.stdout[-1500:]}{proc.stderr[-3000:]}"
  )


def run_yaml(block: Block) -> str | None:
  import yaml

  from rl import configlib
  from rl.config import GRPOConfig

  try:
    configlib.build(GRPOConfig, yaml.safe_load(block.code) or {})
  except Exception as e:
    return f"{type(e).__name__}: {e}"
  return None


@dataclasses.dataclass
class Report:
  ran: collections.Counter
  skipped: collections.Counter  # reason -> blocks
  text: int
  failures: list[tuple[Block, str]]
  seconds: float

  def lines(self) -> list[str]:
    ran = sum(self.ran.values())
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.ran.items()))
    out = [f"examples: {ran} code blocks ran ({kinds}), {sum(self.skipped.values())} skipped, "
           f"{len(self.failures)} failed, {self.text} text blocks (not code), {self.seconds:.0f} s"]  # fmt: skip
    out += [f"examples: skipped {n}: {reason}" for reason, n in self.skipped.most_common()]
    return out


def check(root: pathlib.Path, only: list[pathlib.Path] | None = None) -> Report:
  start = time.monotonic()
  files = [p.resolve() for p in only] if only else sources(root)
  blocks = [b for path in files for b in blocks_of(path, root)]
  ran, skipped, failures, text = collections.Counter(), collections.Counter(), [], 0
  python: dict[str, list[Block]] = collections.defaultdict(list)
  for b in blocks:
    if b.skip:
      skipped[b.skip] += 1
    elif b.lang in PYTHON:
      python[b.path].append(b)
    elif b.lang in SHELL:
      ran["shell"] += 1
      if err := run_shell(b, root):
        failures.append((b, err))
    elif b.lang in YAML:
      ran["yaml"] += 1
      if err := run_yaml(b):
        failures.append((b, err))
    else:
      text += 1
  if python:
    results = run_python_pages(python, root)
    for bs in python.values():
      for b in bs:
        ran["python"] += 1
        if results.get(b.where):
          failures.append((b, results[b.where]))
  return Report(ran, skipped, text, failures, time.monotonic() - start)


def start_check(app) -> None:
  """Starts the examples in a thread when the build starts: they run in subprocesses, beside
  Sphinx reading the pages (one core each on a 2-core machine), and are collected after it."""
  import concurrent.futures

  pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  app.grpo_examples = pool.submit(check, pathlib.Path(app.srcdir).parent)
  pool.shutdown(wait=False)


def sphinx_check(app, env) -> None:
  from sphinx.util import logging

  log = logging.getLogger(__name__)
  report = app.grpo_examples.result()
  for line in report.lines():
    log.info(line)
  for block, err in report.failures:
    log.warning("example failed (%s block):\n%s", block.lang, err, location=block.where)


def setup(app):
  app.connect("builder-inited", start_check)
  app.connect("env-check-consistency", sphinx_check)
  return {"parallel_read_safe": True}


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--python-worker":
    python_worker(pathlib.Path(sys.argv[2]))
  else:
    r = check(pathlib.Path(__file__).resolve().parents[2], [pathlib.Path(a) for a in sys.argv[1:]])
    print("\n".join(r.lines()))
    for b, err in r.failures:
      print(f"FAILED {b.where} ({b.lang}):\n{err}")
    sys.exit(1 if r.failures else 0)
