"""A seeded 4x4 frozen lake (deterministic moves): walk from the start to the goal around the holes.

The observation draws the board (`@` you, `G` goal, `H` hole, `.` ice) and asks for one move. The
first of the words up / down / left / right in a reply is the move (a reply with none is invalid: it
costs a turn, the board is shown again). Reaching the goal ends the episode with reward 1; stepping
into a hole, or running out of turns, ends it with reward 0. A move into the edge stays put.
Every seed gives a solvable layout whose shortest path is at least `min_distance` moves.
"""

from __future__ import annotations

import collections
import random
import re

from rl.env.base import StepResult, check_max_turns

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
OBSERVATIONS = ("board", "words", "safe")
_MOVE = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)


def shortest_path(size: int, holes: frozenset, start: tuple, goal: tuple) -> int | None:
  """Moves from start to goal avoiding holes (BFS), None when unreachable."""
  seen, queue = {start: 0}, collections.deque([start])
  while queue:
    cell = queue.popleft()
    if cell == goal:
      return seen[cell]
    for dr, dc in MOVES.values():
      nxt = (cell[0] + dr, cell[1] + dc)
      if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in seen:
        seen[nxt] = seen[cell] + 1
        queue.append(nxt)
  return None


def best_move(size: int, holes: frozenset, start: tuple, goal: tuple) -> str | None:
  """The first move of a shortest path from start to goal (ties: the order of MOVES), None when the
  goal is unreachable or already reached."""
  best = None
  for name, (dr, dc) in MOVES.items():
    nxt = (start[0] + dr, start[1] + dc)
    if not (0 <= nxt[0] < size and 0 <= nxt[1] < size) or nxt in holes:
      continue
    dist = shortest_path(size, holes, nxt, goal)
    if dist is not None and (best is None or dist < best[0]):
      best = (dist, name)
  return None if best is None or start == goal else best[1]


class GridEnv:
  """The seeded frozen lake: a `size` x `size` board with `holes` holes, the start at least
  `min_distance` moves from the goal; the model answers with a move per turn, at most `max_turns`
  turns. `observation` is how a turn shows the board (rl.config's env.grid_observation)."""

  def __init__(
    self,
    size: int = 4,
    holes: int = 3,
    max_turns: int = 8,
    min_distance: int = 2,
    observation: str = "board",
  ):
    for name, value, lo in (
      ("size", size, 2),
      ("holes", holes, 0),
      ("min_distance", min_distance, 1),
    ):
      if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"GridEnv {name} must be an int >= {lo}, got {value!r}")
    if holes > size * size - 2 - min_distance + 1:
      raise ValueError(f"GridEnv holes={holes} leaves no room for a path on a {size}x{size} board")
    if min_distance > 2 * (size - 1):
      raise ValueError(f"GridEnv min_distance={min_distance} exceeds the {size}x{size} diameter")
    if observation not in OBSERVATIONS:
      raise ValueError(
        f"GridEnv observation must be one of {', '.join(OBSERVATIONS)}, got {observation!r}"
      )
    self.size, self.num_holes, self.min_distance = size, holes, min_distance
    self.observation = observation
    self.max_turns = check_max_turns(max_turns)
    self.pos = self.goal = None
    self.holes: frozenset = frozenset()
    self.turn = 0
    self.done = True

  def layout(self, seed: int) -> tuple[tuple, tuple, frozenset, int]:
    """(start, goal, holes, shortest path) of seed `seed`: redrawn until solvable and far enough."""
    rng = random.Random(int(seed))
    cells = [(r, c) for r in range(self.size) for c in range(self.size)]
    while True:
      start, goal, *holes = rng.sample(cells, 2 + self.num_holes)
      holes = frozenset(holes)
      dist = shortest_path(self.size, holes, start, goal)
      if dist is not None and dist >= self.min_distance:
        return start, goal, holes, dist

  def render(self) -> str:
    return self.board() if self.observation == "board" else self.words()

  def words(self) -> str:
    """The state in words a small byte model can read: where the goal is from here, and which moves
    go into a hole or against the edge (`words`) or, the complement, which moves are safe (`safe`:
    picking a listed word is a copy, which the small model learns sooner than avoiding one)."""
    (r, c), (gr, gc) = self.pos, self.goal
    parts = [f"{abs(gr - r)} {'down' if gr > r else 'up'}"] if gr != r else []
    parts += [f"{abs(gc - c)} {'right' if gc > c else 'left'}"] if gc != c else []
    avoid = [
      name
      for name, (dr, dc) in MOVES.items()
      if (r + dr, c + dc) in self.holes or not (0 <= r + dr < self.size and 0 <= c + dc < self.size)
    ]
    if self.observation == "safe":
      safe = [name for name in MOVES if name not in avoid]
      return f"Goal: {', '.join(parts)}. Safe: {', '.join(safe) or 'nothing'}."
    return f"Goal: {', '.join(parts)}. Avoid: {', '.join(avoid) or 'nothing'}."

  def board(self) -> str:
    rows = []
    for r in range(self.size):
      row = []
      for c in range(self.size):
        cell = (r, c)
        row.append(
          "@"
          if cell == self.pos
          else "G"
          if cell == self.goal
          else "H"
          if cell in self.holes
          else "."
        )
      rows.append("".join(row))
    return "\n".join(rows)

  def question(self) -> str:  # the first turn's observation; later turns show the state alone
    return self.render() + "\nMove: up, down, left or right?"

  def best_move(self) -> str | None:
    """The expert's move from the current cell (the warm-up's label)."""
    return best_move(self.size, self.holes, self.pos, self.goal)

  def reset(self, seed: int) -> str:
    self.pos, self.goal, self.holes, self.distance = self.layout(seed)
    self.turn, self.done = 0, False
    return self.question()

  def step(self, action: str) -> StepResult:
    if self.done:
      raise RuntimeError("step() before reset() or after the episode ended")
    self.turn += 1
    last = self.turn >= self.max_turns
    match = _MOVE.search(action) if isinstance(action, str) else None
    info = {"turns": self.turn, "valid": match is not None}
    if match is not None:
      dr, dc = MOVES[match.group(1).lower()]
      r, c = self.pos[0] + dr, self.pos[1] + dc
      if 0 <= r < self.size and 0 <= c < self.size:
        self.pos = (r, c)
    if self.pos == self.goal:
      self.done = True
      return StepResult("", 1.0, True, {**info, "success": True})
    if self.pos in self.holes:
      self.done = True
      return StepResult("", 0.0, True, {**info, "success": False, "fell": True})
    self.done = last
    if last:
      info["success"] = False
    prefix = "" if match is not None else "Invalid move.\n"
    return StepResult(prefix + self.render(), 0.0, last, info)
