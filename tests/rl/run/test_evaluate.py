"""The eval_full comparison printed at the end of a run: standard errors by hand."""

import math

import pytest

from rl.run.evaluate import accuracy_change, before_after_table, binomial_se


def test_binomial_se_by_hand():
  assert binomial_se(0.5, 100) == pytest.approx(0.05)
  assert binomial_se(0.0, 200) == 0.0 and binomial_se(1.0, 200) == 0.0
  assert binomial_se(0.3, 0) == pytest.approx(math.sqrt(0.21))  # no examples: n clamps to 1


def test_accuracy_change_in_standard_errors_of_the_difference():
  # 0.1 -> 0.3 on 200: se = hypot(sqrt(.09/200), sqrt(.21/200)) = sqrt(.3/200) = 0.03873
  diff, z = accuracy_change(0.1, 0.3, 200)
  assert diff == pytest.approx(0.2) and z == pytest.approx(0.2 / math.sqrt(0.3 / 200))
  assert accuracy_change(0.5, 0.4, 100)[1] < 0  # a drop is negative
  assert accuracy_change(0.0, 0.0, 50) == (0.0, 0.0)  # no spread, no change: not NaN
  assert accuracy_change(0.0, 1.0, 50)[1] == math.inf


def _row(acc, fmt=0.9, length=17.0, n=200.0):
  return {
    "eval_full/accuracy": acc,
    "eval_full/format": fmt,
    "eval_full/completion_length": length,
    "eval_full/examples": n,
  }


def test_before_after_table_puts_the_runs_side_by_side():
  text = before_after_table(_row(0.1), _row(0.3, fmt=1.0, length=15.5))
  assert "200 examples" in text
  lines = {line.split()[0]: line.split() for line in text.splitlines()[2:]}
  assert lines["accuracy"][1:4] == ["0.100", "0.300", "+0.200"]
  assert lines["accuracy"][4] == f"({0.2 / math.sqrt(0.3 / 200):+.1f}"
  assert lines["format"][1:] == ["0.900", "1.000"]
  assert lines["completion"][2:] == ["17.000", "15.500"]
