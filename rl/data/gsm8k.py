"""GSM8K `{question, answer}` jsonl files (openai/grade-school-math layout): train.jsonl / test.jsonl."""

from __future__ import annotations

import dataclasses
import json
import os

from rl.data.rewards import normalize_number


@dataclasses.dataclass(frozen=True)
class Example:
  question: str
  answer: str  # the full worked solution, ending in "#### <gold>"
  gold: str  # the normalised final answer


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where `data.dataset=gsm8k` looks when `data.path` is not given, in order: a copy inside the checkout
# (ignored by git), then the data directory shared beside it.
DEFAULT_DIRS = (
  os.path.join(_ROOT, "data", "gsm8k"),
  os.path.join(os.path.dirname(_ROOT), "shared", "data", "gsm8k"),
)


def default_dir() -> str:
  """The first of DEFAULT_DIRS holding a test.jsonl; FileNotFoundError listing them otherwise."""
  for d in DEFAULT_DIRS:
    if os.path.isfile(os.path.join(d, "test.jsonl")):
      return d
  raise FileNotFoundError(
    "no GSM8K directory given and none found at "
    + " or ".join(DEFAULT_DIRS)
    + " (train.jsonl / test.jsonl): set data.path"
  )


def gold_answer(answer: str) -> str:
  """The normalised text after the last `####` of a GSM8K solution."""
  if "####" not in answer:
    raise ValueError(f"GSM8K answer has no '####' final answer: {answer[-80:]!r}")
  tail = answer.rsplit("####", 1)[1].strip()
  gold = normalize_number(tail)
  if gold is None:
    raise ValueError(f"GSM8K final answer {tail!r} is not a number")
  return gold


def load_gsm8k(
  path: str | os.PathLike, split: str | None = None, limit: int | None = None
) -> list[Example]:
  """Reads GSM8K examples.

  Args:
    path: a jsonl file, or a directory holding `{split}.jsonl`.
    split: "train" or "test" when `path` is a directory.
    limit: keep the first `limit` examples (file order), None for all.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    if split is None:
      raise ValueError(f"{path} is a directory: pass split='train' or 'test'")
    path = os.path.join(path, f"{split}.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"GSM8K file not found: {path}")
  examples = []
  with open(path) as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        examples.append(Example(row["question"], row["answer"], gold_answer(row["answer"])))
      except (json.JSONDecodeError, KeyError, ValueError) as e:
        raise ValueError(f"{path}:{line_no}: not a GSM8K record ({e})") from e
      if limit is not None and len(examples) >= limit:
        break
  return examples
