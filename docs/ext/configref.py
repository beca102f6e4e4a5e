"""The configuration reference, generated from the config dataclasses at build time.

At build time it walks ``rl.config.GRPOConfig``'s dataclass tree into docs/_generated/config.md (which
docs/config.md includes): one table per section: every key with its type, its default, its allowed values and what it does. Allowed values
come from the code the validators run: a section's ``RANGES`` table (``rl.configlib.Range``), its
``CHOICES`` and ``RULES`` tables, and ``Literal`` annotations (which ``rl.configlib`` enforces when a
YAML file or an override is read). What a key does is its field's comment in the source (the comment
block above it and the comment on its line), else its entry in the class docstring (``name: text``).
A key with no description is a warning, so an error under ``-W``.

``{value}`module.attr``` prints a constant of the code (a limit, a default) where prose needs it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxRole

LOG = logging.getLogger(__name__)
NOQA = re.compile(r"noqa:\s*[A-Z0-9, ]+(\([^)]*\))?\s*")


def resolve(path: str):
  module, _, attr = path.rpartition(".")
  obj = importlib.import_module(module)
  for part in attr.split("."):
    obj = getattr(obj, part)
  return obj


def field_comments(cls) -> dict[str, str]:
  """Each field's comments in the class source: the block above it and those within its statement."""
  source = textwrap.dedent(inspect.getsource(cls))
  tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
  comments: dict[str, list[str]] = {}
  pending: list[str] = []
  field, blank, depth = None, True, 0
  for i, tok in enumerate(tokens):
    if tok.type == tokenize.COMMENT:
      text = NOQA.sub("", tok.string.lstrip("#").strip()).strip()
      if field is not None:
        comments[field].append(text)
      elif tok.start[1] == 2:
        pending.append(text)
    elif tok.type == tokenize.NL and blank:
      pending = []  # a blank line ends a comment block
    elif tok.type == tokenize.NEWLINE:
      field = None
    elif tok.type == tokenize.OP and tok.string in "([{":
      depth += 1
    elif tok.type == tokenize.OP and tok.string in ")]}":
      depth -= 1
    elif tok.type == tokenize.NAME and tok.start[1] == 2 and field is None and depth == 0:
      nxt = tokens[i + 1] if i + 1 < len(tokens) else None
      if nxt is not None and nxt.string == ":":
        field = tok.string
        comments[field] = pending
      pending = []
    blank = tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
  return {k: " ".join(v).strip() for k, v in comments.items()}


def docstring_entries(cls) -> dict[str, str]:
  """``name: text`` (or ``a, b: text``) paragraphs of the class docstring."""
  entries: dict[str, str] = {}
  current: list[str] = []
  for line in class_doc(cls).splitlines():
    m = re.match(r"^([a-z_]+(?:, [a-z_]+)*): (.*)$", line)
    if m:
      current = [m.group(2)]
      for name in m.group(1).split(", "):
        entries[name] = current
    elif current and line.startswith(" "):
      current.append(line.strip())
    else:
      current = []
  return {k: " ".join(v) for k, v in entries.items()}


def class_doc(cls) -> str:
  """The class docstring, or "" where it is the one dataclasses generates (the signature)."""
  doc = inspect.getdoc(cls) or ""
  return "" if doc.startswith(cls.__name__ + "(") else doc


def type_name(tp) -> str:
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin in (typing.Union, types.UnionType):
    return " | ".join(type_name(a) for a in args)
  if origin is typing.Literal:
    return "str"
  if origin in (tuple, list):
    return f"list of {type_name(args[0])}" if args else "list"
  if tp is type(None):
    return "null"
  if dataclasses.is_dataclass(tp):
    return "section"
  return getattr(tp, "__name__", str(tp))


def yaml_value(v) -> str:
  if v is None:
    return "null"
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, (tuple, list)):
    return "[" + ", ".join(yaml_value(x) for x in v) + "]"
  if isinstance(v, str):
    return v if v else '""'
  return repr(v)


def default_of(f: dataclasses.Field) -> str:
  if f.default is not dataclasses.MISSING:
    if dataclasses.is_dataclass(f.default):
      return "(the section below)"
    return f"`{yaml_value(f.default)}`"
  if f.default_factory is not dataclasses.MISSING:
    return f"`{yaml_value(f.default_factory())}`"
  return "(required)"


def allowed_of(cls, f: dataclasses.Field, tp) -> str:
  name = f.name
  ranges = getattr(cls, "RANGES", {})
  if name in ranges:
    return ranges[name].describe()
  if name in getattr(cls, "CHOICES", {}):
    values = ", ".join(f"`{v}`" for v in cls.CHOICES[name])
    optional = type(None) in typing.get_args(tp)
    return f"one of {values}" + (" or null" if optional else "")
  if name in getattr(cls, "RULES", {}):
    return cls.RULES[name]
  args = typing.get_args(tp)
  literal = [
    a for a in (args if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,))
  ]
  for a in literal:
    if typing.get_origin(a) is typing.Literal:
      values = ", ".join(f"`{v}`" for v in typing.get_args(a))
      return f"one of {values}" + (" or null" if type(None) in args else "")
  if tp is bool:
    return "`true` or `false`"
  return "any " + type_name(tp)


def cell(text: str) -> str:
  return text.replace("|", "\\|").replace("\n", " ")


def section_tables(cls, prefix: str, problems: list[str]) -> list[str]:
  """Markdown: `cls`'s table (its keys under `prefix`), then one per nested section."""
  hints = typing.get_type_hints(cls)
  comments, entries = field_comments(cls), docstring_entries(cls)
  rows = ["| key | type | default | allowed | what it does |", "|---|---|---|---|---|"]
  nested = []
  for f in dataclasses.fields(cls):
    if not f.init:
      continue
    tp, key = hints[f.name], f"{prefix}{f.name}"
    doc = comments.get(f.name) or entries.get(f.name, "")
    if dataclasses.is_dataclass(tp):
      nested.append((tp, key))
      doc = doc or class_doc(tp).split("\n\n")[0].replace("\n", " ")
    if not doc:
      problems.append(key)
    rows.append(
      f"| `{key}` | {cell(type_name(tp))} | {cell(default_of(f))} | "
      f"{cell(allowed_of(cls, f, tp))} | {cell(doc)} |"
    )
  lines = []
  if prefix:
    lines += [f"## `{prefix.rstrip('.')}`", ""]
    doc = class_doc(cls)
    if doc and not docstring_entries(cls):
      lines += [doc, ""]
    lines += [f"Defined by {{py:class}}`{cls.__module__}.{cls.__qualname__}`.", ""]
  lines += rows + [""]
  for tp, key in nested:
    lines += section_tables(tp, key + ".", problems)
  return lines


def generate(app) -> None:
  """docs/_generated/config.md: the tables of ``rl.config.GRPOConfig`` (docs/config.md includes it)."""
  import pathlib

  root = "rl.config.GRPOConfig"
  problems: list[str] = []
  lines = section_tables(resolve(root), "", problems)
  for key in problems:
    LOG.warning("config key %s has no description (a comment beside its field)", key)
  keys = sum(1 for line in lines if line.startswith("| `"))
  LOG.info("configref: %s: %d keys, %d without a description", root, keys, len(problems))
  out = pathlib.Path(app.srcdir) / "_generated"
  out.mkdir(exist_ok=True)
  text = "<!-- generated by docs/ext/configref.py at build time: do not edit -->\n\n" + "\n".join(
    lines
  )
  path = out / "config.md"
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


class ValueRole(SphinxRole):
  """``{value}`module.attr```: a value from the code, printed as code."""

  def run(self):
    try:
      value = resolve(self.text)
    except (ImportError, AttributeError) as e:
      LOG.warning("value role: %s: %s", self.text, e, location=self.get_location())
      return [nodes.literal(text=self.text)], []
    return [nodes.literal(text=yaml_value(value))], []


def setup(app):
  app.connect("builder-inited", generate)
  app.add_role("value", ValueRole())
  return {"parallel_read_safe": True}
