"""Rewards: small pure functions of a completion string. None of them raises, whatever the string.

Numbers compare exactly as fractions, so "1,234", "$1234.00", "1234" and "2468/2" are the same answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from fractions import Fraction

__all__ = [
  "REWARD_FNS",
  "correctness_reward",
  "extract_answer",
  "format_reward",
  "normalize_number",
  "parse_number",
  "score",
]

# One number: optional sign (ASCII or unicode minus; not after a word, as in "5-3") and $, thousands
# groups or plain digits, decimals, or a fraction a/b.
_NUMBER = re.compile(
  r"(?:(?<![\w.)])(?P<sign>[-\u2212]))?\s?\$?\s?"
  r"(?P<body>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+/\d+|\d+|\.\d+)(?![\d])"
)
_FRAC = re.compile(r"\\d?frac\{\s*([-\u2212]?[\d.,]+)\s*\}\{\s*([\d.,]+)\s*\}")
_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT_LINE = re.compile(r"(?:^|\n)####[ \t]*" + _NUMBER.pattern + r"[ \t]*\.?\s*\Z")


def parse_number(text: str) -> Fraction | None:
  """The first number in `text` as an exact Fraction, or None. "-1,234.50" -> -2469/2; "3/4" -> 3/4."""
  m = _NUMBER.search(_FRAC.sub(r"\1/\2", text))
  return _to_fraction(m) if m else None


def _to_fraction(m: re.Match) -> Fraction | None:
  body = m.group("body").replace(",", "")
  try:
    value = Fraction(body)
  except (ValueError, ZeroDivisionError):
    return None
  return -value if m.group("sign") else value


def _last_number(text: str) -> Fraction | None:
  matches = list(_NUMBER.finditer(_FRAC.sub(r"\1/\2", text)))
  for m in reversed(matches):
    value = _to_fraction(m)
    if value is not None:
      return value
  return None


def _boxed(text: str) -> str | None:
  """The contents of the last \\boxed{...}, braces balanced."""
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  i, depth = start + len("\\boxed{"), 1
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None


def extract_answer(completion: str) -> Fraction | None:
  """The final answer of a completion, looking in order for `#### x`, `\\boxed{x}`, `<answer>x</answer>`,
  and otherwise taking the last number in the text."""
  if not isinstance(completion, str):
    return None
  hashes = _HASHES.findall(completion)
  if hashes:
    value = parse_number(hashes[-1])  # "#### 1,234 apples": the number right after the marker
    if value is not None:
      return value
  for segment in (_boxed(completion), *(_ANSWER_TAG.findall(completion)[-1:])):
    if segment:
      value = _last_number(segment)
      if value is not None:
        return value
  return _last_number(completion)


def normalize_number(text: str) -> str | None:
  """A canonical string for the number in `text` (commas, `$`, trailing `.0` removed; fractions reduced)."""
  value = parse_number(text)
  if value is None:
    return None
  return _decimal(value) or f"{value.numerator}/{value.denominator}"


def _decimal(value: Fraction) -> str | None:
  """The exact plain decimal ("0.00001", never "1e-05") when the denominator is 2^a * 5^b, else None."""
  rest, twos, fives = value.denominator, 0, 0
  while rest % 2 == 0:
    rest, twos = rest // 2, twos + 1
  while rest % 5 == 0:
    rest, fives = rest // 5, fives + 1
  if rest != 1:
    return None
  places = max(twos, fives)
  digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
  whole, frac = digits[: len(digits) - places], digits[len(digits) - places :].rstrip("0")
  return ("-" if value < 0 else "") + whole + (f".{frac}" if frac else "")


def correctness_reward(completion: str, gold: str) -> float:
  """1.0 when the completion's final answer equals the gold answer exactly (as numbers), else 0.0."""
  target = parse_number(gold) if isinstance(gold, str) else None
  return 1.0 if target is not None and extract_answer(completion) == target else 0.0


def format_reward(completion: str, gold: str | None = None) -> float:
  """1.0 when the completion ends with a `#### <number>` line (GSM8K's answer format), else 0.0."""
  del gold
  return 1.0 if isinstance(completion, str) and _FORMAT_LINE.search(completion) else 0.0


RewardFn = Callable[[str, str], float]
REWARD_FNS: dict[str, RewardFn] = {"correct": correctness_reward, "format": format_reward}


def score(completion: str, gold: str, weights: Mapping[str, float]) -> dict[str, float]:
  """Every weighted reward of one completion, plus their weighted sum under "total"."""
  unknown = set(weights) - set(REWARD_FNS)
  if unknown:
    raise ValueError(f"unknown reward functions {sorted(unknown)}; known: {sorted(REWARD_FNS)}")
  parts = {name: REWARD_FNS[name](completion, gold) for name in weights}
  parts["total"] = sum(weights[name] * value for name, value in parts.items())
  return parts
