"""Where a result came from: the commit of the tree that produced it (bench reports, the loop's
history rows). Its own module so that bench.report and bench.loop.step_time both import it, not each other."""

from __future__ import annotations

import pathlib
import subprocess

__all__ = ["git_commit"]


def git_commit() -> str | None:
  """HEAD's sha, with "-dirty" when the tree has uncommitted changes; None outside a git checkout."""
  root = pathlib.Path(__file__).resolve().parents[1]
  try:
    sha = subprocess.run(
      ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return sha + ("-dirty" if dirty else "")
