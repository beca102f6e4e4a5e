"""Tables and figures of the committed results, rendered from their files at build time.

Every directory under ``bench/results/`` holding a result file (``results.json``, ``learning.json``,
``parity.json``, ``mismatch.json``; nested reports included) becomes ``docs/_generated/results/<path>.md``, which the
manual's pages include. Each starts with its provenance (device, versions, the commit the file
records, ``-dirty`` said in words, and the commit that added it to the repository), then:

* a bench report (``results.json`` with an ``environment``): the tables ``bench.report`` renders from
  it, re-rendered here into a temporary copy (nothing is measured);
* any other result file: the summary its tool wrote beside it (``summary.md``, ``learning.md``,
  ``parity.md``, ``mismatch.md``), generated from the same run, never typed;
* the figures in the directory (PNG files rendered from the same results).

No number in these pages is typed by hand: a new or re-measured report changes them on the next build.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import tempfile

from sphinx.util import logging

LOG = logging.getLogger(__name__)
RESULT_FILES = ("results.json", "learning.json", "parity.json", "mismatch.json")
SUMMARIES = ("summary.md", "learning.md", "parity.md", "mismatch.md")


def result_dirs(results: pathlib.Path) -> list[pathlib.Path]:
  """The committed result directories: git's tracked result files (a local run's report, ignored by
  git, is not the manual's), or the ``example-*`` directories outside a git checkout."""
  root = results.parents[1]
  try:
    tracked = subprocess.run(
      ["git", "ls-files", "--", *(f"{results.relative_to(root)}/**/{n}" for n in RESULT_FILES)],
      cwd=root, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    files = [root / f for f in tracked]
  except (OSError, subprocess.CalledProcessError):
    files = [p for name in RESULT_FILES for p in results.glob(f"example-*/**/{name}")]
  return sorted({p.parent for p in files})


def committed_in(path: pathlib.Path, root: pathlib.Path) -> str:
  """The commit (short sha, date) that last changed `path` in git, or a note when it is not tracked."""
  try:
    out = subprocess.run(
      ["git", "log", "-1", "--format=%h (%cs)", "--", str(path)],
      cwd=root, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
  except (OSError, subprocess.CalledProcessError):
    out = ""
  return out or "not committed"


def commit_words(commit: str | None) -> str:
  if not commit:
    return "not recorded in the file"
  if "-dirty" in commit:
    return f"`{commit}` (the tree had uncommitted changes when it ran)"
  return f"`{commit}`"


def provenance(data: dict) -> list[tuple[str, str]]:
  """(what, value) rows from a result file's own record of where it came from."""
  env = data.get("environment") or {}
  rows = []
  device = env.get("device_kind") or data.get("device")
  if device:
    count = env.get("device_count")
    rows.append(("device", f"{device}" + (f" x {count}" if count and count > 1 else "")))
  if env.get("measurement"):
    rows.append(("measurement", env.get("label") or env["measurement"]))
  elif env.get("interpret_mode"):
    rows.append(
      (
        "measurement",
        "Pallas interpreter on CPU: checks the harness and parity, not kernel performance",
      )
    )
  versions = [
    f"{k} {v}"
    for k in ("jax", "jaxlib", "libtpu", "python", "sglang_jax")
    if (v := env.get(k) or data.get(k))
  ]
  if versions:
    rows.append(("versions", ", ".join(versions)))
  date = env.get("date") or data.get("date")
  if date:
    rows.append(("date", str(date)))
  if "config" in data and isinstance(data["config"], str):
    rows.append(
      (
        "config",
        f"`{data['config']}`"
        + (f", overrides {data['overrides']}" if data.get("overrides") else ""),
      )
    )
  if data.get("seeds"):
    rows.append(("seeds", ", ".join(map(str, data["seeds"]))))
  rows.append(("commit (recorded)", commit_words(env.get("git_commit"))))
  return rows


def demote(markdown: str, levels: int) -> str:
  return re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + levels) + " ", markdown, flags=re.M)


def bench_report_body(directory: pathlib.Path) -> str:
  """summary.md as bench.report renders it from results.json today (in a temporary copy)."""
  from bench import report

  with tempfile.TemporaryDirectory() as tmp:
    shutil.copy(directory / "results.json", tmp)
    report.render(pathlib.Path(tmp), plots=False)
    text = (pathlib.Path(tmp) / "summary.md").read_text()
  return text.split("\n", 1)[1] if text.startswith("# ") else text


def tool_summary(directory: pathlib.Path) -> str:
  for name in SUMMARIES:
    if (directory / name).exists():
      text = (directory / name).read_text()
      return text.split("\n", 1)[1] if text.startswith("# ") else text
  return ""


def render(directory: pathlib.Path, root: pathlib.Path, out: pathlib.Path) -> str:
  name = directory.relative_to(root / "bench" / "results").as_posix()
  file = next(directory / f for f in RESULT_FILES if (directory / f).exists())
  data = json.loads(file.read_text())
  lines = [f"## `{name}`", ""]
  lines += [f"From `bench/results/{name}/{file.name}`.", ""]
  rows = provenance(data) + [("committed to the repository", committed_in(directory, root))]
  lines += ["| provenance | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]
  is_bench = file.name == "results.json" and "environment" in data and "cases" in data
  body = bench_report_body(directory) if is_bench else tool_summary(directory)
  lines += [demote(body.strip(), 1), ""]
  up = pathlib.Path(*[".."] * len(out.relative_to(root).parts))
  for png in sorted(directory.glob("*.png")):
    lines += [f"![{png.stem}]({(up / png.relative_to(root)).as_posix()})", ""]
  return "\n".join(lines)


def loop_history(root: pathlib.Path) -> str:
  """bench/history/loop.jsonl (python -m bench.loop.step_time's rows) as a table, every row as recorded."""
  path = root / "bench" / "history" / "loop.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  lines = [
    "| date | commit (recorded) | device | jax | config (digest) | overrides | median step s [min, max] "
    "| rollout s | update s | tokens/s | timed steps |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['date'][:10]} | {commit_words(r.get('commit'))} | {r['device_kind']} | {r['jax']} "
      f"| `{r['config']}` ({r.get('config_digest', '-')}) | {' '.join(r.get('overrides') or []) or '-'} "
      f"| {r['step_s']:.3f} [{r['step_s_min']:.3f}, {r['step_s_max']:.3f}] | {r['rollout_s']:.3f} "
      f"| {r['update_s']:.3f} | {r['tokens_per_s']:.0f} | {r.get('timed_steps', '-')} |"
    )
  return "\n".join(lines) + "\n"


def generate(app) -> None:
  root = pathlib.Path(app.srcdir).parent
  out = pathlib.Path(app.srcdir) / "_generated" / "results"
  out.mkdir(parents=True, exist_ok=True)
  written, sections = set(), []
  head = "<!-- generated by docs/ext/results.py at build time: do not edit -->\n\n"
  for directory in result_dirs(root / "bench" / "results"):
    name = directory.relative_to(root / "bench" / "results").as_posix().replace("/", "--")
    path = out / f"{name}.md"
    sections.append(render(directory, root, out))
    text = head + sections[-1]
    if not path.exists() or path.read_text() != text:
      path.write_text(text)
    written.add(path)
  everything = out / "all.md"  # every committed result, for docs/results.md
  if not everything.exists() or everything.read_text() != head + "\n".join(sections):
    everything.write_text(head + "\n".join(sections))
  written.add(everything)
  history = out / "loop-history.md"
  text = "<!-- generated by docs/ext/results.py at build time: do not edit -->\n\n"
  text += loop_history(root)
  if not history.exists() or history.read_text() != text:
    history.write_text(text)
  written.add(history)
  for stale in set(out.glob("*.md")) - written:
    stale.unlink()
  LOG.info("results: %d committed result directories rendered", len(written))


def nox_sessions(root: pathlib.Path) -> str:
  """The noxfile's sessions as a table: name and the first paragraph of its docstring (read with ast:
  nothing runs), so a new or renamed session shows up here on the next build."""
  import ast

  tree = ast.parse((root / "noxfile.py").read_text())
  rows = ["| session | what it runs |", "|---|---|"]
  for fn in tree.body:
    decorated = isinstance(fn, ast.FunctionDef) and any(
      "session" in ast.unparse(d) for d in fn.decorator_list
    )
    if decorated:
      doc = (ast.get_docstring(fn) or "").split("\n\n")[0].replace("\n", " ").replace("|", "\\|")
      rows.append(f"| `nox -s {fn.name}` | {doc} |")
  return "\n".join(rows) + "\n"


def write_sessions(app) -> None:
  out = pathlib.Path(app.srcdir) / "_generated"
  out.mkdir(exist_ok=True)
  text = "<!-- generated by docs/ext/results.py from noxfile.py: do not edit -->\n\n"
  text += nox_sessions(out.parents[1])
  path = out / "nox-sessions.md"
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


def setup(app):
  app.connect("builder-inited", generate)
  app.connect("builder-inited", write_sessions)
  return {"parallel_read_safe": True}
