"""Rewards never raise, and a correctly formatted correct answer always scores 1."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.data.rewards import (
  correctness_reward,
  extract_answer,
  format_reward,
  normalize_number,
  parse_number,
  score,
)


@pytest.mark.parametrize(
  "text,value",
  [
    ("#### 72", 72),
    ("so #### 1,234 apples", 1234),
    ("#### $1,000.00", 1000),
    ("#### -5", -5),
    ("#### \u22123", -3),
    (r"The answer is \boxed{42}.", 42),
    (r"\boxed{\frac{3}{4}}", Fraction(3, 4)),
    (r"\boxed{\dfrac{-1}{2}}", Fraction(-1, 2)),
    ("<answer>The total is 18.</answer>", 18),
    ("<answer>7</answer> then 99", 7),
    # Several answers: the LAST one of a kind counts (a model that revises itself).
    ("<answer>3</answer> no, wait: <answer>5</answer>", 5),
    (r"\boxed{3} no, wait: \boxed{\frac{5}{2}}", Fraction(5, 2)),
    ("#### 3\nrechecking...\n#### 5", 5),
    (r"\boxed{4} then <answer>9</answer>", 4),  # a box before an answer tag, wherever they are
    ("She pays 12.50 dollars", Fraction(25, 2)),
    ("10 - 4 = 6", 6),
    ("5-3", 3),
    ("ratio 2/3", Fraction(2, 3)),
    ("about .5", Fraction(1, 2)),
    ("#### nothing\nbut 8 later", 8),
    ("no numbers here", None),
    ("1/0", None),
    ("", None),
  ],
)
def test_extract_answer(text, value):
  assert extract_answer(text) == (Fraction(value) if value is not None else None)


@pytest.mark.parametrize(
  "text,canonical",
  [
    ("1,234", "1234"),
    ("$5", "5"),
    ("5.0", "5"),
    ("7.50", "7.5"),
    ("-0.25", "-0.25"),
    ("6/4", "1.5"),
    ("1/3", "1/3"),
    (".00001", "0.00001"),  # never "1e-05" (which parses back as 1)
    ("123456789.123456789", "123456789.123456789"),
    ("x", None),
  ],
)
def test_normalize_number(text, canonical):
  assert normalize_number(text) == canonical


@settings(max_examples=400)  # pure Python and cheap: the global 8-example cap is for kernels
@given(st.text())
def test_rewards_never_raise_on_any_string(text):
  assert correctness_reward(text, "12") in (0.0, 1.0)
  assert correctness_reward("#### 12", text) in (0.0, 1.0)
  assert format_reward(text) in (0.0, 1.0)
  answer, number, canonical = extract_answer(text), parse_number(text), normalize_number(text)
  assert answer is None or isinstance(answer, Fraction)
  # The canonical string is the same number again, and exists exactly when a number was found.
  assert (canonical is None) == (number is None)
  if canonical is not None:
    assert parse_number(canonical) == number, (text, canonical)
  # The gold side: a completion that states the text's number as its answer is correct.
  if number is not None:
    assert correctness_reward(f"#### {canonical}", text) == 1.0


_reasoning = st.text(
  st.characters(blacklist_characters="#\\<", blacklist_categories=("Cs",)), max_size=60
)
_values = st.one_of(
  st.integers(-(10**7), 10**7).map(Fraction),
  st.decimals(-(10**5), 10**5, places=2, allow_nan=False, allow_infinity=False).map(Fraction),
)


def _render(value: Fraction, commas: bool) -> str:
  if value.denominator == 1:
    return f"{value.numerator:,}" if commas else str(value.numerator)
  return f"{float(value):,.2f}" if commas else f"{float(value):.2f}"


@settings(max_examples=400)  # pure Python and cheap: the global 8-example cap is for kernels
@given(_reasoning, _values, st.booleans(), st.sampled_from(["####", "boxed", "answer"]))
def test_formatted_correct_answers_always_score_one(reasoning, value, commas, style):
  gold = _render(value, commas=False)
  shown = _render(value, commas)
  completion = {
    "####": f"{reasoning}\n#### {shown}",
    "boxed": f"{reasoning} \\boxed{{{shown}}}",
    "answer": f"{reasoning}<answer>{shown}</answer>",
  }[style]
  assert correctness_reward(completion, gold) == 1.0, completion
  if style == "####":
    assert format_reward(completion) == 1.0


def test_rewards_return_the_documented_values():
  """Each reward's value on known completions: right / wrong answer, format kept / broken."""
  gold = "1,234"
  assert correctness_reward("so 1000 + 234 = 1234\n#### 1234", gold) == 1.0
  assert correctness_reward("#### 1235", gold) == 0.0
  assert correctness_reward("#### 1234", "no number") == 0.0  # an unusable gold never matches
  assert correctness_reward(r"\boxed{1234} no wait \boxed{1243}", gold) == 0.0  # the last box
  assert format_reward("work\n#### 1234") == 1.0
  assert format_reward("#### 1234 and more words") == 0.0  # the answer line must end it
  assert format_reward(r"\boxed{1234}") == 0.0


def test_score_weights_and_unknown_names():
  parts = score("2 + 2 = 4\n#### 4", "4", {"correct": 1.0, "format": 0.5})
  assert parts == {"correct": 1.0, "format": 1.0, "total": 1.5}
  assert score("the answer is 5", "4", {"correct": 1.0, "format": 0.5})["total"] == 0.0
  with pytest.raises(ValueError, match="unknown reward"):
    score("x", "1", {"brevity": 1.0})
