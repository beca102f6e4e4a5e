"""A seeded generator of GSM8K-format integer word problems: the embedded default task.

Level k chains k arithmetic steps. Each solution writes one `a op b = c` line per step and ends with
`#### c`, exactly GSM8K's answer format, so the same rewards and prompt template apply. Level 0 has no
step: the answer is the number the question states, a pure copy — the skill every other level needs
first (reading an operand out of the question) and the one a small model from scratch lacks longest.
Numbers stay small and every intermediate is a non-negative integer, so a tiny model can learn the
task on CPU.
"""

from __future__ import annotations

import random

from rl.data.gsm8k import Example, gold_answer

NAMES = ("Ann", "Ben", "Cal", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim")
ITEMS = ("apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles")
WORD_LEVELS = (1, 2, 3)  # the word problems: generate()'s default
LEVELS = (0, *WORD_LEVELS)


def _step(rng: random.Random, value: int, item: str) -> tuple[str, str, int]:
  """One more step applied to the running `value`: (sentence, equation, new value)."""
  op = rng.choice("+-*") if value <= 30 else rng.choice("+-")
  if op == "+":
    b = rng.randint(1, 9)
    return f"Then gets {b} more {item}.", f"{value} + {b} = {value + b}", value + b
  if op == "-" and value > 1:
    b = rng.randint(1, min(9, value - 1))
    return f"Then gives away {b} {item}.", f"{value} - {b} = {value - b}", value - b
  b = rng.randint(2, 3)
  return f"Then the {item} are multiplied by {b}.", f"{value} * {b} = {value * b}", value * b


def make_example(rng: random.Random, level: int) -> Example:
  if level not in LEVELS:
    raise ValueError(f"difficulty level must be one of {LEVELS}, got {level}")
  name, item = rng.choice(NAMES), rng.choice(ITEMS)
  value = rng.randint(2, 12)
  sentences, equations = [f"{name} has {value} {item}."], []
  for _ in range(level):
    sentence, equation, value = _step(rng, value, item)
    sentences.append(sentence)
    equations.append(equation)
  question = " ".join(sentences) + f" How many {item} does {name} have?"
  answer = "\n".join([*equations, f"#### {value}"])
  return Example(question, answer, gold_answer(answer))


def generate(n: int, seed: int = 0, levels: tuple[int, ...] = WORD_LEVELS) -> list[Example]:
  """`n` problems, levels drawn uniformly from `levels` (the word problems by default; level 0 is
  opt-in); the same (n, seed, levels) gives the same list."""
  if n < 0:
    raise ValueError(f"n must be non-negative, got {n}")
  rng = random.Random(seed)
  return [make_example(rng, rng.choice(levels)) for _ in range(n)]
