"""The tool-use arithmetic environment on GSM8K-format problems.

Each turn the model either calls the calculator, `<calc>12*7</calc>` (the first complete tag counts;
the rest of the reply is ignored), and the next observation is `<result>84</result>` (or
`<error>...</error>` for an expression it cannot evaluate), or replies without a tag: that reply is
the final answer, scored with `rl.data.rewards.score` (correctness + format weights), and the episode ends.
After `max_turns` turns the episode ends anyway, unanswered, with reward 0.

The calculator evaluates +, -, *, /, ** and parentheses on exact fractions from a parsed syntax tree,
never `eval`: names, calls, attributes and anything else are refused, and sizes are bounded.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

from rl.data import Example, rewards
from rl.env.base import StepResult, check_max_turns

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_EXPR_CHARS = 100
MAX_MAGNITUDE = 10**15  # larger results are refused (no huge integers from 9**9**9)
MAX_EXPONENT = 16
INSTRUCTIONS = "Use <calc>expr</calc> to compute; end with #### <answer>."

_BINOPS = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.Div: operator.truediv,
  ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
  """An expression the calculator refuses; the message is shown to the model."""


def safe_eval(expression: str) -> Fraction:
  """The exact value of an arithmetic expression (numbers, + - * / **, parentheses). CalcError for
  anything else, a division by zero, a non-integer or too large exponent, or a result whose
  magnitude exceeds MAX_MAGNITUDE."""
  if not isinstance(expression, str):
    raise CalcError(f"expression must be text, got {type(expression).__name__}")
  text = expression.strip().replace(",", "").replace("\u00d7", "*").replace("\u2212", "-")
  if not text or len(text) > MAX_EXPR_CHARS:
    raise CalcError(f"expression must have 1 to {MAX_EXPR_CHARS} characters")
  try:
    tree = ast.parse(text, mode="eval")
  except SyntaxError as e:
    raise CalcError(f"cannot parse {text!r}") from e
  return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
  if isinstance(node, ast.Constant):
    if isinstance(node.value, bool) or not isinstance(node.value, int | float):
      raise CalcError("only numbers are allowed")
    if not math.isfinite(node.value):  # 1e999 parses as inf
      raise CalcError("result too large")
    return _bounded(Fraction(str(node.value)))  # str: 0.1 is 1/10, not its binary approximation
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_value(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
    left, right = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Div) and right == 0:
      raise CalcError("division by zero")
    if isinstance(node.op, ast.Pow):
      if right.denominator != 1 or abs(right) > MAX_EXPONENT:
        raise CalcError(f"exponents must be integers in [-{MAX_EXPONENT}, {MAX_EXPONENT}]")
      if left == 0 and right < 0:
        raise CalcError("division by zero")
      size = max(abs(left.numerator), left.denominator)
      if size > 1 and abs(right) * math.log10(size) > 18:  # before computing it
        raise CalcError("result too large")
    return _bounded(_BINOPS[type(node.op)](left, right))
  raise CalcError(f"unsupported expression element {type(node).__name__}")


def _bounded(value: Fraction) -> Fraction:
  if abs(value.numerator) > MAX_MAGNITUDE * value.denominator or value.denominator > MAX_MAGNITUDE:
    raise CalcError("result too large")
  return value


def format_value(value: Fraction) -> str:
  """84, 2.5 or 1/3: what the calculator answers."""
  if value.denominator == 1:
    return str(value.numerator)
  return rewards.normalize_number(f"{value.numerator}/{value.denominator}")


class CalcEnv:
  """Episodes over `examples` (synthetic or GSM8K): `reset(seed)` poses `examples[seed % N]`."""

  def __init__(
    self,
    examples: Sequence[Example],
    max_turns: int = 3,
    reward_weights: Mapping[str, float] | None = None,
  ):
    if not examples:
      raise ValueError("CalcEnv needs at least one example")
    self.examples = list(examples)
    self.max_turns = check_max_turns(max_turns)
    self.weights = dict(reward_weights or {"correct": 1.0, "format": 0.1})
    rewards.score("", "0", self.weights)  # unknown reward names fail here, not mid-episode
    self.example: Example | None = None
    self.turn = 0

  def reset(self, seed: int) -> str:
    self.example = self.examples[int(seed) % len(self.examples)]
    self.turn = 0
    return f"{self.example.question}\n{INSTRUCTIONS}"

  def step(self, action: str) -> StepResult:
    if self.example is None:
      raise RuntimeError("step() before reset()")
    if self.turn >= self.max_turns:
      raise RuntimeError("step() after the episode ended")
    self.turn += 1
    last = self.turn >= self.max_turns
    call = CALL.search(action)
    if call is None:  # a final answer
      parts = rewards.score(action, self.example.gold, self.weights)
      info = {"success": parts.get("correct", 0.0) == 1.0, "answered": True, "turns": self.turn}
      info.update({f"reward/{k}": v for k, v in parts.items()})
      self.turn = self.max_turns
      return StepResult("", parts["total"], True, info)
    try:
      observation = f"<result>{format_value(safe_eval(call.group(1)))}</result>"
      ok = True
    except CalcError as e:
      observation, ok = f"<error>{e}</error>", False
    info = {"tool_call": call.group(1), "tool_ok": ok, "turns": self.turn}
    if last:
      info.update(success=False, answered=False)
    return StepResult(observation, 0.0, last, info)
