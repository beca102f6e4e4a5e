"""Reading sglang-jax's returned log-probs (no sglang-jax needed): its 0.1.0rc0 client appends the whole
list so far at every 50th token, so a long completion's list carries repeated prefixes before the full
one; only that exact pattern is accepted, and the entries must name the output tokens."""

import pytest

from rl.rollout.sglang_jax import completion_logprobs


def _entries(tokens, seed=0):
  return [(-0.01 * ((7 * i + seed) % 13) - 0.1, t, None) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("n", [0, 1, 49, 50, 51, 100, 101, 160])
def test_repeated_prefixes_are_dropped(n):
  tokens = [(3 * i) % 11 + 2 for i in range(n)]  # periodic: repeats inside the completion too
  full = _entries(tokens)
  sent = [
    e for k in range(50, n, 50) for e in full[:k]
  ] + full  # prefixes 50, 100, ... < n, then all
  assert completion_logprobs(sent, tokens) == full
  assert completion_logprobs(full, tokens) == full  # a fixed sglang-jax: nothing repeated


def test_other_shapes_are_errors():
  tokens = list(range(5, 65))  # 60 tokens
  full = _entries(tokens)
  with pytest.raises(RuntimeError, match="repeated-prefix"):
    completion_logprobs(
      full[:10] + full, tokens
    )  # a repeated head that is not the 50-token prefix...
  with pytest.raises(RuntimeError, match="repeated-prefix"):
    completion_logprobs(_entries(tokens, seed=1)[:50] + full, tokens)  # ...or not this completion's
  with pytest.raises(RuntimeError, match="only 59 log-probs"):
    completion_logprobs(full[:-1], tokens)
  with pytest.raises(RuntimeError, match="other tokens"):
    completion_logprobs(_entries(tokens[1:] + [0]), tokens)
