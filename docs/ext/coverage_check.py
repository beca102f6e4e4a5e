"""The build fails when a public name has no documentation (optax's docs/ext/coverage_check.py idea).

Public: ``kernels.__all__``, each module's ``__all__`` and every ``python -m`` command (apigen's
walk). Checked after the pages are read: each name has an entry in the Python domain where apigen put
it, each class and function has a docstring, every ``__all__`` entry exists, every module imports
(a skipped module's names would be undocumented) and every command's ``--help`` exits 0.
"""

from __future__ import annotations

import inspect

from sphinx.errors import ExtensionError
from sphinx.util import logging

LOG = logging.getLogger(__name__)


def check(app, env) -> None:
  api = getattr(app, "grpo_api", None)
  if api is None:
    raise ExtensionError("coverage_check: apigen did not run")
  py = env.get_domain("py")
  objects, modules = py.objects, py.modules
  problems = [f"{m}: in __all__ but not defined" for m in api.missing]
  problems += [f"{m}: not importable ({why})" for m, why in api.skipped.items()]
  documented = 0
  for p in api.publics:
    name = f"{p.module}.{p.name}"
    target = p.canonical
    if p.kind == "module":
      ok = target in modules
    else:
      ok = target in objects
    if not ok:
      problems.append(f"{name}: no entry ({target} is not in the API reference)")
      continue
    if p.kind in ("class", "function") and not (inspect.getdoc(p.obj) or "").strip():
      problems.append(f"{name}: no docstring")
      continue
    documented += 1
  commands = 0
  for command, (status, _) in sorted(api.helps.items()):
    if status:
      problems.append(f"python -m {command} --help exited with status {status}")
    else:
      commands += 1
  LOG.info(
    "coverage: %d / %d public names documented, %d / %d commands with their --help, %d modules",
    documented, len(api.publics), commands, len(api.clis), len(api.modules),
  )  # fmt: skip
  if problems:
    raise ExtensionError("coverage check failed:\n  " + "\n  ".join(problems))


def setup(app):
  app.connect("env-check-consistency", check)
  return {"parallel_read_safe": True}
