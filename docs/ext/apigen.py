"""The API and command-line reference, generated from the code at build time.

Packages and modules are discovered by walking ``kernels``, ``rl`` and ``bench`` (pkgutil), never
from a hand-written list, so a module that moves or appears gets its page on the next build. Public
means ``kernels.__all__`` and each module's ``__all__``; a module without ``__all__`` gets a page with
its docstring only (a map entry, no members). Every ``python -m`` command (a module with a
``__main__`` guard, or a package's ``__main__.py``) gets its ``--help`` output, run at build time.

A name public in several modules (``kernels.grpo_loss`` re-exports ``kernels.grpo_loss.grpo_loss``)
is documented once, where it is defined (or the public module nearest to that), and listed with a
link on the other pages. Optional packages (``optional_imports`` in conf.py) that are not installed are
mocked while importing, and said in the build log; a module that still cannot import is skipped
with its reason in the log and its names reported by the coverage check.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import io
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

from sphinx.ext.autodoc.mock import mock
from sphinx.util import logging

LOG = logging.getLogger(__name__)
PACKAGES = ("kernels", "rl", "bench")
SCALARS = (int, float, complex, str, bytes, bool, type(None))
HELP_COLUMNS = "100"


@dataclasses.dataclass
class Public:
  """One public name: `module.name`, its object and where it is documented (`canonical`)."""

  module: str
  name: str
  obj: object
  canonical: str = ""
  kind: str = ""  # module | class | function | data


@dataclasses.dataclass
class Api:
  modules: list[str]  # every module that imported, in walk order
  skipped: dict[str, str]  # module -> why it could not be imported
  publics: list[Public]
  missing: list[str]  # names in an __all__ that the module does not have
  clis: dict[str, str]  # `python -m X` -> the module documenting it
  helps: dict[str, tuple[int, str]]  # X -> (exit status, --help output)
  mocked: list[str]


def walk(packages=PACKAGES) -> list[str]:
  """Every module of `packages`, packages first, in pkgutil's order (imports each package)."""
  names = []
  for p in packages:
    pkg = importlib.import_module(p)
    names.append(p)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, p + ".")]
  return names


def missing_optional(optional) -> list[str]:
  return [m for m in optional if importlib.util.find_spec(m) is None]


def kind_of(obj) -> str:
  if inspect.ismodule(obj):
    return "module"
  if inspect.isclass(obj):
    return "class"
  routine = inspect.isroutine(obj) or isinstance(obj, functools.partial)
  if routine or (callable(obj) and hasattr(obj, "__wrapped__")):
    return "function"
  return "data"


def _home(entries: list[Public]) -> Public:
  """Where a name public in several modules is documented: where it is defined, else the public
  module sharing the longest prefix with its defining module (the shorter on a tie: the package that
  re-exports it), else the first listing."""
  first = entries[0]
  defined = getattr(first.obj, "__module__", None) if first.kind in ("class", "function") else None
  if defined:
    for e in entries:
      if e.module == defined:
        return e

    def shared(e: Public) -> int:
      a, b = e.module.split("."), defined.split(".")
      return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return max(entries, key=lambda e: (shared(e), -len(e.module)))  # ties: the re-exporting package
  return first


def collect(optional=()) -> Api:
  mocked = missing_optional(optional)
  skipped, modules, publics, missing = {}, [], [], []
  with mock(mocked):
    for name in walk():
      try:
        mod = importlib.import_module(name)
      except Exception as e:  # a module that cannot import is reported, not fatal here
        skipped[name] = f"{type(e).__name__}: {e}"
        continue
      modules.append(name)
      for n in getattr(mod, "__all__", ()):
        if not hasattr(mod, n):
          missing.append(f"{name}.{n}")
          continue
        obj = getattr(mod, n)
        publics.append(Public(name, n, obj, kind=kind_of(obj)))
  groups: dict[object, list[Public]] = {}
  for p in publics:
    key = (p.name, p.module) if isinstance(p.obj, SCALARS) else (p.kind, id(p.obj))
    groups.setdefault(key, []).append(p)
  for entries in groups.values():
    home = _home(entries)
    for e in entries:
      e.canonical = e.obj.__name__ if e.kind == "module" else f"{home.module}.{home.name}"
  clis = cli_modules(modules)
  return Api(modules, skipped, publics, missing, clis, {}, mocked)


def cli_modules(modules) -> dict[str, str]:
  """`python -m X` commands: X -> the module whose page documents it."""
  clis = {}
  for name in modules:
    mod = sys.modules[name]
    path = getattr(mod, "__file__", None) or ""
    if name.endswith(".__main__"):
      clis[name.removesuffix(".__main__")] = name
    elif (
      path.endswith(".py")
      and not path.endswith("__init__.py")
      and 'if __name__ == "__main__"' in pathlib.Path(path).read_text()
    ):
      clis[name] = name
  return clis


def run_help(command: str, root: pathlib.Path) -> tuple[int, str]:
  env = dict(
    os.environ,
    COLUMNS=HELP_COLUMNS,
    PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
  )
  env.setdefault("JAX_PLATFORMS", "cpu")
  proc = subprocess.run(
    [sys.executable, "-m", command, "--help"],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  return proc.returncode, proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr


def run_helps(clis, root: pathlib.Path) -> dict[str, tuple[int, str]]:
  with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
    futures = {c: pool.submit(run_help, c, root) for c in clis}
    return {c: f.result() for c, f in futures.items()}


def _title(text: str, char: str = "=") -> list[str]:
  return [text, char * len(text), ""]


def _directive(p: Public) -> list[str]:
  target = f"{p.module}.{p.name}"
  if p.kind == "class":
    return [f".. autoclass:: {target}", "   :members:", ""]
  if p.kind == "function":
    return [f".. autofunction:: {target}", ""]
  lines = [f".. autodata:: {target}"]
  if len(repr(p.obj)) > 120:
    lines.append("   :no-value:")
  return lines + [""]


def _role(p: Public) -> str:
  return {"module": "py:mod", "class": "py:class", "function": "py:func"}.get(p.kind, "py:obj")


def module_page(name: str, api: Api) -> str:
  mod = sys.modules[name]
  own = [p for p in api.publics if p.module == name]
  lines = [".. This page is generated by docs/ext/apigen.py at build time: do not edit.", ""]
  lines += _title(f"``{name}``")
  lines += [f".. automodule:: {name}", ""]
  here = [p for p in own if p.kind != "module" and p.canonical == f"{name}.{p.name}"]
  elsewhere = [p for p in own if p not in here]
  if here:
    lines += _title("Public names", "-")
    for p in here:
      lines += _directive(p)
  if elsewhere:
    lines += _title("Also public here", "-")
    lines += ["Documented where they are defined:", ""]
    lines += [f"* ``{p.name}``: :{_role(p)}:`{p.canonical}`" for p in elsewhere] + [""]
  if not hasattr(mod, "__all__"):
    lines += [".. rubric:: No ``__all__``", ""]
    lines += ["This module declares no public names: its docstring above is its documentation.", ""]
  commands = [c for c, m in api.clis.items() if m == name]
  for c in commands:
    status, text = api.helps.get(c, (1, "not run"))
    lines += [f".. _cli-{c}:", ""]
    lines += _title(f"``python -m {c}``", "-")
    if status:
      lines += [f"``--help`` exited with status {status}:", ""]
    lines += [".. code-block:: text", ""]
    lines += ["   " + line if line.strip() else "" for line in text.rstrip().splitlines()] + [""]
  submodules = [m for m in api.modules if m.rpartition(".")[0] == name]
  if submodules:
    lines += _title("Modules", "-")
    lines += [".. toctree::", "   :maxdepth: 1", ""] + [f"   {m}" for m in submodules] + [""]
  return "\n".join(lines)


def index_page(api: Api) -> str:
  lines = [".. This page is generated by docs/ext/apigen.py at build time: do not edit.", ""]
  lines += _title("API reference")
  lines += [
    "Generated from the code at build time: every module of ``kernels``, ``rl`` and ``bench``"
    " (found by walking the packages), each module's ``__all__`` and every ``python -m`` command's"
    " ``--help``. The build fails when a public name has no entry (docs/ext/coverage_check.py).",
    "",
    ".. toctree::",
    "   :maxdepth: 1",
    "",
    "   commands",
  ]
  lines += [f"   {p}" for p in PACKAGES] + [""]
  return "\n".join(lines)


def commands_page(api: Api) -> str:
  lines = [".. This page is generated by docs/ext/apigen.py at build time: do not edit.", ""]
  lines += _title("Commands (``python -m``)")
  lines += [
    "Every module runnable as ``python -m``, found by its ``__main__`` guard; each links to its"
  ]
  lines += ["``--help`` output, captured when this page was built.", ""]
  for c in sorted(api.clis):
    summary = (inspect.getdoc(sys.modules[api.clis[c]]) or "").strip().split("\n")[0]
    lines += [f"* :ref:`python -m {c} <cli-{c}>` — {summary}" if summary else f"* :ref:`cli-{c}`"]
  return "\n".join(lines + [""])


def package_map(api: Api) -> str:
  """Markdown: every package (not module) with the first line of its docstring, for the
  architecture page (docs/_generated/packages.md): the map follows the code as packages move."""
  rows = ["| package | what it holds |", "|---|---|"]
  for name in api.modules:
    mod = sys.modules[name]
    if hasattr(mod, "__path__"):
      first = (inspect.getdoc(mod) or "").strip().split("\n\n")[0].replace("\n", " ")
      rows.append(f"| {{py:mod}}`{name}` | {first.replace('|', '/')} |")
  return "\n".join(rows) + "\n"


def write_if_changed(path: pathlib.Path, text: str) -> None:
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


def generate(app) -> None:
  root = pathlib.Path(app.confdir).parent
  out = pathlib.Path(app.srcdir) / "api"
  out.mkdir(exist_ok=True)
  api = collect(app.config.optional_imports)
  app.config.autodoc_mock_imports = list(api.mocked)
  if api.mocked:
    LOG.info("apigen: mocked imports (not installed here): %s", ", ".join(api.mocked))
  for name, why in api.skipped.items():
    LOG.info("apigen: skipped %s: it cannot be imported (%s)", name, why)
  api.helps = run_helps(api.clis, root)
  pages = {"index": index_page(api), "commands": commands_page(api)}
  pages |= {m: module_page(m, api) for m in api.modules}
  for stale in set(out.glob("*.rst")) - {out / f"{p}.rst" for p in pages}:
    stale.unlink()
  for page, text in pages.items():
    write_if_changed(out / f"{page}.rst", text)
  generated = pathlib.Path(app.srcdir) / "_generated"
  generated.mkdir(exist_ok=True)
  write_if_changed(generated / "packages.md", package_map(api))
  app.grpo_api = api  # the coverage check reads it
  LOG.info(
    "apigen: %d modules, %d public names, %d commands", len(api.modules), len(api.publics),
    len(api.clis),
  )  # fmt: skip


ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:(`[^`]+`)")
VERBATIM: list[str] = []


def rst_problems(lines: list[str]) -> str:
  """What docutils reports parsing a docstring as reStructuredText (Sphinx's roles read as plain
  interpreted text): empty when it renders as written."""
  from docutils.core import publish_doctree

  stream = io.StringIO()
  publish_doctree(
    ROLE.sub(r"\1", "\n".join(lines)),
    settings_overrides={
      "report_level": 2, "halt_level": 5, "warning_stream": stream,
      "file_insertion_enabled": False, "raw_enabled": False,
    },
  )  # fmt: skip
  return stream.getvalue()


def verbatim_when_not_rst(app, what, name, obj, options, lines) -> None:
  """Docstrings here are plain text with reST where it helps (``code``, roles, ``::`` blocks). One
  that reST cannot parse cleanly (an indented continuation, a table of ``|`` rows) is shown as
  written, in a literal block, rather than mangled or failing the strict build."""
  if lines and rst_problems(lines):
    VERBATIM.append(name)
    lines[:] = ["::", ""] + ["   " + line if line.strip() else "" for line in lines] + [""]


def report_verbatim(app, exception) -> None:
  if exception is None and VERBATIM:
    LOG.info("apigen: %d docstrings shown verbatim (not valid reST as written)", len(VERBATIM))


def setup(app):
  app.connect("autodoc-process-docstring", verbatim_when_not_rst)
  app.connect("build-finished", report_verbatim)
  app.add_config_value("optional_imports", [], "env")
  app.connect("builder-inited", generate)
  return {"parallel_read_safe": True, "env_version": 1}
