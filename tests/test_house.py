"""The house rules docs/development.md states, checked on the source: functions under ~80 lines, modules under
~400; the layers point one way (kernels/ imports neither rl/ nor bench/, rl/ does not import bench/);
no import circles in kernels/, rl/ and bench/ (a circle counts function-local and type-only imports
too: they only hide it from the interpreter, not from a reader); no re-export shims in kernels/."""

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


def _imports(path: pathlib.Path, modules: set[str], me: str | None = None) -> set[str]:
  """The project modules ``path`` (module ``me``) imports, anywhere in the file (``if
  TYPE_CHECKING`` included)."""
  tree = ast.parse(path.read_text())
  me = me or _module_name(path)
  package = me if path.name == "__init__.py" else me.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
      found.add(base.strip("."))
      found.update(f"{base}.{a.name}".strip(".") for a in node.names)
  return {m for m in found if m in modules and m != me}


def _graph() -> dict[str, set[str]]:
  """Module -> the project modules it imports; a submodule's import of its parent package is how
  Python loads it, not a design dependency, and is left out."""
  paths = list(_sources())
  modules = {_module_name(p) for p in paths}
  graph = {_module_name(p): _imports(p, modules) for p in paths}
  return {name: {d for d in deps if not name.startswith(d + ".")} for name, deps in graph.items()}


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
  """Catches: two modules importing each other (directly or around a ring, through type annotations
  too), which makes the import order matter and usually means one concept is split across both. A
  package importing its own submodules is not a circle unless a submodule imports the package back."""
  graph = _graph()
  assert not _cycles(graph), f"import circles: {_cycles(graph)}"


# (layer, layers it must not import): the library under the loop under the benchmarks
LAYERS = (("kernels", ("rl", "bench")), ("rl", ("bench",)))


def test_layers_point_one_way():
  """Catches: the library importing its own benchmark harness or training loop (kernels/ ->
  bench/ or rl/), or the loop importing the benchmarks (rl/ -> bench/)."""
  up = [
    f"{name} -> {dep}"
    for name, deps in _graph().items()
    for layer, above in LAYERS
    if name.split(".")[0] == layer
    for dep in deps
    if dep.split(".")[0] in above
  ]
  assert not up, f"imports against the layering {LAYERS}: {sorted(up)}"


def test_no_reexport_shims_in_kernels():
  """Catches: a name imported into a kernels/ module only so that an old import path keeps working
  (the ``noqa: F401`` that silences the unused import), which hides a move instead of finishing it.
  Package ``__init__`` files are the public facades and may re-export."""
  shims = [
    f"{path.relative_to(ROOT)}:{n}"
    for path in sorted((ROOT / "kernels").rglob("*.py"))
    if path.name != "__init__.py"
    for n, line in enumerate(path.read_text().splitlines(), 1)
    if "noqa: F401" in line
  ]
  assert not shims, f"re-exports outside package __init__ files: {shims}"


@pytest.mark.parametrize("bad", ["a -> b -> a"])
def test_cycle_finder_finds_a_ring(bad):
  """The checker itself can fail: a two-module ring is reported."""
  assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_type_only_imports_count(tmp_path):
  """The checker reads ``if TYPE_CHECKING`` imports (the grpo_loss Mosaic modules' circle hid there)."""
  path = tmp_path / "m.py"
  path.write_text(
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from kernels import ops\n"
  )
  assert _imports(path, {"kernels.ops"}, me="kernels.m") == {"kernels.ops"}
