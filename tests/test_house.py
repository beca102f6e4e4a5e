"""The house rules docs/development.md states, checked on the source: functions under ~80 lines, modules under
~400, no import circles in kernels/, rl/ and bench/ (a circle counts function-local imports too: they
only hide it from the interpreter, not from a reader)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "rl", "bench")
MAX_FUNCTION_LINES = 80  # signature + docstring + body
MAX_MODULE_LINES = 400


def _sources():
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      if "results" not in path.parts:
        yield path


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_functions_and_modules_are_small():
  """Catches: a function or module grown past the size a reader can hold (the review's habit)."""
  long_functions, long_modules = [], []
  for path in _sources():
    text = path.read_text()
    if text.count("\n") > MAX_MODULE_LINES:
      long_modules.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))}")
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
  assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
  assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
  """The project modules ``path`` imports, anywhere in the file but under ``if TYPE_CHECKING``."""
  tree = ast.parse(path.read_text())
  skip = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      skip.update(id(n) for n in ast.walk(node))
  me = _module_name(path)
  package = me if path.name == "__init__.py" else me.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
      found.add(base.strip("."))
      found.update(f"{base}.{a.name}".strip(".") for a in node.names)
  return {m for m in found if m in modules and m != me}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  return out


def test_no_import_circles():
  """Catches: two modules importing each other (directly or around a ring), which makes the import
  order matter and usually means one concept is split across both. A package importing its own
  submodules is not a circle unless a submodule imports the package back."""
  paths = list(_sources())
  modules = {_module_name(p) for p in paths}
  graph = {_module_name(p): _imports(p, modules) for p in paths}
  # a submodule's import of its parent package is how Python loads it, not a design dependency
  for name, deps in graph.items():
    graph[name] = {d for d in deps if not name.startswith(d + ".")}
  assert not _cycles(graph), f"import circles: {_cycles(graph)}"


@pytest.mark.parametrize("bad", ["a -> b -> a"])
def test_cycle_finder_finds_a_ring(bad):
  """The checker itself can fail: a two-module ring is reported."""
  assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
