"""Sphinx configuration of the manual (`nox -s docs`): Sphinx + MyST Markdown, strict (-W).

Every page is generated or written in Markdown under docs/; the API reference, the command-line
reference, the configuration reference and the result tables are generated from the code and the
committed result files at build time (docs/ext/), so a moved module or a re-measured report needs no
edit here.
"""

from __future__ import annotations

import pathlib
import sys
import tomllib

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(DOCS / "ext"), str(ROOT)]

from bench.provenance import git_commit  # noqa: E402  (the one definition of "commit, -dirty")

project = "grpo-kernels"
release = version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
commit = git_commit() or "unknown (not a git checkout)"
copyright = "the grpo-kernels authors"

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "apigen",  # the API and command-line reference, walked from the packages
  "configref",  # the configuration reference, from the config dataclasses
  "results",  # tables and figures from bench/results/**
  "stamp",  # version + commit on every page
  "coverage_check",  # every public name documented, or the build fails
  "figure_lint",  # no hand-typed timing figure in docs/ or README.md
  "examples",  # every code block runs, or says why not
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "ext", "_generated"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # `[text](page.md#a-heading)` links are checked like any other
# a name in a docstring that several modules define (`mosaic_gpu`) resolves to one of them
suppress_warnings = ["ref.python"]

# Optional packages imported at module top level: mocked when they are not installed (said in the
# build log by apigen), so their modules are documented from the docs environment alone.
optional_imports = ["tunix", "sglang_jax", "wandb", "torch", "liger_kernel", "tokamax", "qwix"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"exclude-members": "__init__, __new__, __post_init__"}

html_theme = "furo"
_short = commit[:12] + ("-dirty" if commit.endswith("-dirty") else "")
html_title = f"{project} {version} ({_short})"
smartquotes = False  # `--check` and "quotes" in docstrings and help texts stay as typed
html_static_path: list[str] = []
html_show_sourcelink = False

# Strict cross-references in the hand-written pages: every {py:...} role there must resolve (to a
# public name, documented by apigen). References inside docstrings (api/ pages) to private helpers
# and to other projects' types are left as plain text (no intersphinx: the build is offline).
nitpicky = True


def _quiet_in_api(app, domain, node):
  return node.get("refdoc", "").startswith("api/") or None


def setup(app):
  app.connect("warn-missing-reference", _quiet_in_api)
