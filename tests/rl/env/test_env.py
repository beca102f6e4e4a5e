"""Environments: the calculator's safe evaluation, the tool-use episode rules, the grid puzzle's seeded
layouts, rewards, max_turns and malformed actions."""

import pathlib
from fractions import Fraction

import pytest

from rl.data import generate_synthetic, load_gsm8k
from rl.env import CalcEnv, GridEnv, safe_eval
from rl.env.calc import CalcError, format_value
from rl.env.grid import shortest_path

GSM8K = pathlib.Path(__file__).resolve().parents[4] / "shared" / "data" / "gsm8k"


# ------------------------------------------------------------------------------------------ calculator
@pytest.mark.parametrize(
  "expr, value",
  [
    ("12*7", 84),
    (" (3 + 4) / 2 ", Fraction(7, 2)),
    ("2**10", 1024),
    ("-3+5", 2),
    ("1,200/4", 300),
    ("0.1+0.2", Fraction(3, 10)),  # exact: no binary rounding
    ("10 - 2 - 3", 5),  # left-associative
    ("2**-2", Fraction(1, 4)),
  ],
)
def test_safe_eval_values(expr, value):
  assert safe_eval(expr) == value


@pytest.mark.parametrize(
  "expr",
  [
    "__import__('os').system('true')",
    "a + 1",
    "abs(-3)",
    "(1).real",
    "[1, 2]",
    "lambda: 1",
    "True + 1",
    "'7' * 3",
    "1/0",
    "0**-1",
    "9**9**9",  # refused before computing it
    "2**0.5",
    "10**30",
    "1e999",
    "",
    "1+" * 60 + "1",
    "3 if 1 else 2",
    "1 < 2",
    "7 // 2",
  ],
)
def test_safe_eval_refuses(expr):
  with pytest.raises(CalcError):
    safe_eval(expr)


def test_format_value():
  assert [format_value(Fraction(x)) for x in ("84", "5/2", "1/3", "-7")] == [
    "84",
    "2.5",
    "1/3",
    "-7",
  ]


# ------------------------------------------------------------------------------------------ calc env
def _calc(max_turns=3):
  return CalcEnv(generate_synthetic(20, seed=3), max_turns=max_turns)


def test_calc_reset_is_seeded_and_poses_the_problem():
  env = _calc()
  first = env.reset(5)
  assert env.reset(6) != first and env.reset(5) == first
  assert env.example.question in first and "<calc>" in first


def test_calc_tool_call_then_correct_answer():
  env = _calc()
  env.reset(0)
  res = env.step("I compute <calc>(2+5)*3</calc> now")
  assert res == res.__class__("<result>21</result>", 0.0, False, res.info)
  assert res.info["tool_ok"]
  final = env.step(f"So\n#### {env.example.gold}")
  assert final.done and final.info["success"] and final.reward == pytest.approx(1.1)
  with pytest.raises(RuntimeError):
    env.step("more")


def test_calc_wrong_or_unformatted_answers():
  env = _calc()
  env.reset(1)
  wrong = int(env.example.gold) + 1
  res = env.step(f"#### {wrong}")
  assert res.done and not res.info["success"] and res.reward == pytest.approx(0.1)  # format only
  env.reset(1)
  res = env.step(f"the answer is {env.example.gold}")  # correct, no #### line
  assert res.done and res.info["success"] and res.reward == pytest.approx(1.0)


def test_calc_malformed_calls_cost_a_turn_and_max_turns_ends_unanswered():
  env = _calc(max_turns=3)
  env.reset(2)
  bad = env.step("<calc>open('x')</calc>")
  assert not bad.done and bad.observation.startswith("<error>") and not bad.info["tool_ok"]
  ok = env.step("<calc>1+1</calc>")
  assert not ok.done and ok.observation == "<result>2</result>"
  last = env.step("<calc>2+2</calc>")  # the third turn: still a tool call, the episode ends
  assert last.done and last.reward == 0.0 and not last.info["success"]
  with pytest.raises(RuntimeError):
    env.step("#### 4")


def test_calc_unclosed_tag_is_a_final_answer():
  env = _calc()
  env.reset(0)
  res = env.step("<calc>12*7")
  assert res.done and "tool_call" not in res.info


def test_calc_bad_arguments():
  with pytest.raises(ValueError, match="max_turns"):
    CalcEnv(generate_synthetic(2), max_turns=0)
  with pytest.raises(ValueError, match="unknown reward"):
    CalcEnv(generate_synthetic(2), reward_weights={"style": 1.0})
  with pytest.raises(ValueError, match="example"):
    CalcEnv([])


@pytest.mark.skipif(not GSM8K.exists(), reason="GSM8K data not present")
def test_calc_on_real_gsm8k():
  examples = load_gsm8k(GSM8K, "test", limit=5)
  env = CalcEnv(examples, max_turns=2)
  assert examples[3].question in env.reset(3)
  res = env.step(f"#### {examples[3].gold}")
  assert res.info["success"] and res.reward == pytest.approx(1.1)


# ------------------------------------------------------------------------------------------ grid
def _solve(env: GridEnv) -> list[str]:
  """A shortest move sequence for the current layout (BFS over moves)."""
  import collections

  from rl.env.grid import MOVES

  prev, queue = {env.pos: None}, collections.deque([env.pos])
  while queue:
    cell = queue.popleft()
    for name, (dr, dc) in MOVES.items():
      nxt = (cell[0] + dr, cell[1] + dc)
      ok = 0 <= nxt[0] < env.size and 0 <= nxt[1] < env.size and nxt not in env.holes
      if ok and nxt not in prev:
        prev[nxt] = (cell, name)
        queue.append(nxt)
  path, cell = [], env.goal
  while prev[cell] is not None:
    cell, name = prev[cell]
    path.append(name)
  return path[::-1]


def test_grid_layouts_are_seeded_solvable_and_varied():
  env = GridEnv()
  boards = {env.reset(s) for s in range(30)}
  assert len(boards) > 20
  for s in range(30):
    first = env.reset(s)
    assert GridEnv().reset(s) == first
    assert first.count("@") == first.count("G") == 1 and first.count("H") == 3
    assert 2 <= shortest_path(env.size, env.holes, env.pos, env.goal) <= env.max_turns


@pytest.mark.parametrize("seed", range(8))
def test_grid_shortest_solution_succeeds(seed):
  env = GridEnv()
  env.reset(seed)
  moves = _solve(env)
  assert len(moves) == env.distance
  for i, move in enumerate(moves):
    res = env.step(f"I go {move.upper()}.")  # the move word anywhere, any case
    assert res.done == (i == len(moves) - 1)
  assert res.reward == 1.0 and res.info["success"]


@pytest.mark.parametrize("seed", range(12))
def test_grid_expert_moves_walk_a_shortest_path(seed):
  """The warm-up's label: every expert move shortens the remaining path by exactly one and never
  enters a hole, so following it reaches the goal in `distance` moves (a move chosen without the
  holes, or a greedy Manhattan step, fails on layouts whose path bends around them)."""
  env = GridEnv(max_turns=16)
  env.reset(seed)
  for i in range(env.distance):
    before = shortest_path(env.size, env.holes, env.pos, env.goal)
    res = env.step(env.best_move())
    assert env.pos not in env.holes
    if i < env.distance - 1:
      assert shortest_path(env.size, env.holes, env.pos, env.goal) == before - 1
  assert res.done and res.info["success"] and env.best_move() is None


def test_grid_words_observation_by_hand():
  """Seed 3: @ at row 1, column 3 and G at row 2, column 1 (board below), so the goal is 1 down and 2
  left and only `right` (the edge) is to avoid; one move left puts a hole above and a hole to the left.
  A swapped axis or sign, an avoid list that forgets the edge, or a safe list that is not its
  complement, fails."""
  env = GridEnv(observation="words")
  first = env.reset(3)
  assert env.board() == "..H.\n.H.@\nHG..\n...."
  assert first == "Goal: 1 down, 2 left. Avoid: right.\nMove: up, down, left or right?"
  res = env.step("left")
  assert res.observation == "Goal: 1 down, 1 left. Avoid: up, left."
  # safe: the complement of the avoid list, in the order up, down, left, right
  env = GridEnv(observation="safe")
  assert env.reset(3).startswith("Goal: 1 down, 2 left. Safe: up, down, left.\n")
  assert env.step("left").observation == "Goal: 1 down, 1 left. Safe: down, right."
  with pytest.raises(ValueError, match="observation must be one of board, words, safe"):
    GridEnv(observation="pixels")


def test_grid_hole_edge_invalid_and_max_turns():
  env = GridEnv(size=4, holes=3, max_turns=3)
  # find a seed whose start touches a hole, then step into it
  for seed in range(100):
    env.reset(seed)
    near = [
      m
      for m, (dr, dc) in {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}.items()
      if (env.pos[0] + dr, env.pos[1] + dc) in env.holes
    ]
    if near:
      break
  res = env.step(near[0])
  assert res.done and res.reward == 0.0 and res.info["fell"] and not res.info["success"]

  env.reset(0)
  start = env.pos
  res = env.step("jump!")
  assert not res.done and res.observation.startswith("Invalid move.") and env.pos == start
  edge = "up" if start[0] == 0 else "down" if start[0] == 3 else "left" if start[1] == 0 else None
  if edge is not None:
    env.step(edge)
    assert env.pos == start  # the edge stops the move
  else:
    env.step("nothing")
  res = env.step("nothing")
  assert res.done and res.reward == 0.0 and not res.info["success"]  # the third turn: out of turns


def test_grid_bad_arguments():
  for kw, key in (({"size": 1}, "size"), ({"holes": 15}, "holes"), ({"max_turns": 0}, "max_turns")):
    with pytest.raises(ValueError, match=key):
      GridEnv(**kw)
  with pytest.raises(RuntimeError):
    GridEnv().step("up")
