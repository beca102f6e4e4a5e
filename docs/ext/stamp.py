"""Every page says which version and which commit it was built from (``-dirty``: the tree had
uncommitted changes, said in words too)."""

from __future__ import annotations

from docutils import nodes


def stamp_text(version: str, commit: str) -> str:
  dirty = commit.endswith("-dirty")
  sha = commit.removesuffix("-dirty")
  note = " (built from a tree with uncommitted changes)" if dirty else ""
  return f"grpo-kernels {version}, built from commit {sha}{'-dirty' if dirty else ''}{note}."


def add_stamp(app, doctree, docname) -> None:
  text = stamp_text(app.config.version, app.config.commit)
  para = nodes.paragraph(classes=["build-stamp"])
  para += nodes.emphasis(text=text)
  doctree += nodes.transition()
  doctree += para


def setup(app):
  app.add_config_value("commit", "unknown", "env")
  app.connect("doctree-resolved", add_stamp)
  return {"parallel_read_safe": True}
