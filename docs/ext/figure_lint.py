"""No hand-typed timing figure in README.md or the hand-written pages of docs/: measured (or
modelled) times live in the committed result files and reach the manual through the ``results``
directive, dated ones in CHANGELOG.md. A number followed by a time or rate unit in prose is a
warning (an error under -W), with its file and line; code blocks and inline code are not prose."""

from __future__ import annotations

import pathlib
import re

from sphinx.util import logging

LOG = logging.getLogger(__name__)
UNITS = (
  r"ns|µs|us|ms|s|sec|secs|seconds?|mins?|minutes?|h|hours?|"
  r"[KMGTP]B/s|[GTP]F/s|[GTP]FLOP/s|FLOP/s|tok/s|tokens/s"
)
FIGURE = re.compile(
  rf"(?<![\w.\-/])\d+(?:[.,]\d+)?(?:\s?[-–]\s?\d+(?:[.,]\d+)?)?\s?(?:{UNITS})(?![\w/])"
)
FENCE = re.compile(r"^\s*(```|~~~|:::)")
CODE_SPAN = re.compile(r"`[^`]*`")
SKIP_DIRS = {"api", "_build", "_generated", "ext"}  # generated pages render result files


def prose_lines(text: str):
  """(line number, text) of the lines outside fenced blocks, inline code removed."""
  fence = None
  for i, line in enumerate(text.splitlines(), 1):
    m = FENCE.match(line)
    if m:
      fence = None if fence == m.group(1) else (fence or m.group(1))
      continue
    if fence is None and not line.startswith("    "):
      yield i, CODE_SPAN.sub("", line)


def figures(path: pathlib.Path) -> list[tuple[int, str]]:
  return [
    (i, m.group(0)) for i, line in prose_lines(path.read_text()) for m in FIGURE.finditer(line)
  ]


def sources(docs: pathlib.Path) -> list[pathlib.Path]:
  pages = [p for p in docs.rglob("*.md") if not SKIP_DIRS & set(p.relative_to(docs).parts)]
  return sorted(pages) + [docs.parent / "README.md"]


def lint(app) -> None:
  docs = pathlib.Path(app.srcdir)
  count = 0
  for path in sources(docs):
    for line, text in figures(path):
      count += 1
      LOG.warning(
        "hand-typed timing figure %r: render it from a result file ({results}) or move it to "
        "CHANGELOG.md", text, location=f"{path}:{line}",
      )  # fmt: skip
  LOG.info("figure_lint: %d hand-typed timing figures in README.md and docs/", count)


def setup(app):
  app.connect("builder-inited", lint)
  return {"parallel_read_safe": True}
