"""Token sampling on device: temperature, top-k, top-p, greedy, each row with its own settings and key.

Returns the log-probability of the drawn token under the distribution it was drawn from, which is what
an off-policy correction (or a check against a teacher-forced forward) needs.

The distribution (`processed_logprobs`), per row, with z = logits / temperature (temperature 0: z =
logits, and the token is the argmax):
  * top-k (k > 0): keep the k largest z (ties: the lower token id first; lax.top_k ranks +0.0 above
    -0.0, the only order the two forms differ on); k >= V is off.
  * top-p (p < 1): order the kept tokens by z, descending; q = softmax over the top-k set (the whole
    vocabulary when top-k is off); keep each token whose mass *before* it, sum of q over the tokens
    ranked above it, is < p. The top token is always kept. p = 1 is off.
  * the result is log_softmax(z) renormalised over the kept set (-inf outside it).
This is the sort-based definition `processed_logprobs_sorted` spells out (the reference); the sampler
computes the same distribution without sorting the vocabulary:
  * no filter in the batch (top_k 0 / >= V and top_p 1 in every row, the GRPO default): log_softmax(z)
    alone, no sort, no top-k;
  * otherwise `lax.top_k` over a bounded candidate set of the `candidates` largest z per row. The result
    is exact when every filtered row's kept set provably lies inside its candidates: k <= candidates,
    or top-k off and the candidates' full-vocabulary mass already reaches p (the nucleus ends inside
    them). Only when some row fails that (top_k > candidates, or a nucleus wider than the candidates on
    a flat distribution) does the batch fall back to the full sort.
p = 1 is exactly "off" here; the sorted form's float32 cumulative sum can reach 1.0 before the last
tokens and so drops tail tokens (probability below ~1e-7) even at p = 1; the sampler keeps them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CANDIDATES = (
  64  # the bounded candidate set of top-k / top-p: lax.top_k width before a fallback sort
)


def _scaled(logits, temperature):  # [B, V], [B] -> [B, V] f32 logits / temperature (greedy: / 1)
  t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
  return logits.astype(jnp.float32) / t


def _filtered(v: int, top_k, top_p):  # [B], [B] -> [B] bool: the row restricts its distribution
  return ((top_k > 0) & (top_k < v)) | (top_p < 1.0)


def processed_logprobs_sorted(
  logits,  # [B, V] f32
  temperature,  # [B] f32; 0 = greedy (plain softmax)
  top_k,  # [B] int32; 0 = off
  top_p,  # [B] f32; 1 = off
):  # -> [B, V] f32 log-probs, -inf outside the kept set
  """The reference definition: one descending sort of the vocabulary serves both filters (rank < k,
  and cumulative mass before a token < p). The sampler's fallback; tests compare against it."""
  v = logits.shape[-1]
  z = _scaled(logits, temperature)
  order = jnp.argsort(-z, axis=-1)
  zs = jnp.take_along_axis(z, order, axis=-1)
  rank = jnp.arange(v)[None, :]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
  keep_sorted = rank < k
  ps = jax.nn.softmax(jnp.where(keep_sorted, zs, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(ps, axis=-1) - ps
  keep_sorted &= (mass_before < top_p[:, None]) | (rank == 0)  # the top token is always kept
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(keep_sorted)
  return jax.nn.log_softmax(jnp.where(keep, z, -jnp.inf), axis=-1)


def candidate_logprobs(
  z,  # [B, V] f32 scaled logits
  top_k,  # [B] int32
  top_p,  # [B] f32
  candidates: int = CANDIDATES,
):  # -> ([B, V] f32 log-probs over the kept set, [B] bool: exact for the row)
  """The filtered distribution from the `candidates` largest z of each row (`lax.top_k`, no sort of
  the vocabulary), and whether it provably equals the sorted definition for that row."""
  b, v = z.shape
  c = min(candidates, v)
  vals, idx = jax.lax.top_k(z, c)  # [B, C] descending; ties: lower index first, as the stable sort
  rank = jnp.arange(c)[None, :]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]  # [B, 1]
  in_k = rank < k
  # top-p reads the softmax over the top-k set: inside the candidates when k <= C, else (top-k off,
  # k = V) the full vocabulary's normaliser, which needs no sort
  lse_k = jax.nn.logsumexp(jnp.where(in_k, vals, -jnp.inf), axis=-1, keepdims=True)
  lse_v = jax.nn.logsumexp(z, axis=-1, keepdims=True)
  q = jnp.where(in_k, jnp.exp(vals - jnp.where(k <= c, lse_k, lse_v)), 0.0)
  mass_before = jnp.cumsum(q, axis=-1) - q
  keep = in_k & ((mass_before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0))
  # Exact when the kept set cannot reach past the candidates: the top-k is inside them, or (top-k
  # off) the mass before candidate C, i.e. the candidates' total, is already >= p.
  exact = (k[:, 0] <= c) | ((k[:, 0] == v) & (jnp.sum(q, axis=-1) >= top_p))
  kept = jnp.where(keep, vals, -jnp.inf)
  logp = kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True)
  out = jnp.full((b, v), -jnp.inf, jnp.float32).at[jnp.arange(b)[:, None], idx].set(logp)
  return out, exact


def processed_logprobs(
  logits,  # [B, V] f32
  temperature,  # [B] f32; 0 = greedy (plain softmax)
  top_k,  # [B] int32; 0 = off
  top_p,  # [B] f32; 1 = off
  candidates: int = CANDIDATES,
):  # -> [B, V] f32 log-probs, -inf outside the kept set
  """The log-softmax of logits / temperature restricted to the top-k, then the top-p nucleus (the
  module docstring gives the exact semantics); sorts the vocabulary only when a bounded candidate set
  cannot give the exact answer."""
  v = logits.shape[-1]
  z = _scaled(logits, temperature)
  plain = jax.nn.log_softmax(z, axis=-1)
  filtered = _filtered(v, top_k, top_p)

  def restrict():
    out, exact = candidate_logprobs(z, top_k, top_p, candidates)
    out = jax.lax.cond(
      jnp.all(exact | ~filtered),
      lambda: out,
      lambda: processed_logprobs_sorted(logits, temperature, top_k, top_p),
    )
    return jnp.where(filtered[:, None], out, plain)

  return jax.lax.cond(jnp.any(filtered), restrict, lambda: plain)


def sample(
  logits,  # [B, V] f32
  keys,  # [B] typed PRNG keys
  temperature,  # [B] f32
  top_k,  # [B] int32
  top_p,  # [B] f32
  filtered: bool
  | None = None,  # static: some row filters; False: none does; None: decide on device
):  # -> ([B] int32 tokens, [B] f32 log-probs)
  """Draw one token per row (temperature 0: the argmax) and its log-prob under the distribution it
  was drawn from. `filtered=False` (the caller knows no row has top-k / top-p, the GRPO default)
  compiles only the plain pass: no top-k candidates and no fallback sort in the program at all."""
  if filtered is False:
    return sample_plain(logits, keys, temperature)
  logp = processed_logprobs(logits, temperature, top_k, top_p)
  drawn = jax.vmap(jax.random.categorical)(keys, logp)
  greedy = jnp.argmax(logits, axis=-1)
  tokens = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
  plain = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.where(temperature[:, None] > 0, logp, plain)
  return tokens, jnp.take_along_axis(chosen, tokens[:, None], axis=-1)[:, 0]


BLOCK = 128  # vocabulary block of the plain sampler's two-level inverse CDF: a TPU vector's lanes


def sample_plain(
  logits,  # [B, V] f32
  keys,  # [B] typed PRNG keys
  temperature,  # [B] f32; 0 = greedy
):  # -> ([B] int32 tokens, [B] f32 log-probs under log_softmax(logits / temperature))
  """`sample_blocked` on [B, V] logits, cut into blocks of BLOCK tokens (the last one padded with
  -inf, which is never drawn). The decode loop gives `sample_blocked` its blocks straight from the
  LM head instead (rl.rollout.steps.next_tokens): cut after the head, they cost XLA TPU two more
  writes of the [B, V] logits, to relay them out."""
  b, v = logits.shape
  nb = -(-v // BLOCK)
  # The logits as they came: without the barrier XLA moves the cut into the matmul before it, onto
  # an untied [H, V] head kernel, and transposes the kernel in memory every call (Qwen2.5-7B on v4:
  # 2.2 GB of copies per decode chunk, where cutting the logits costs 20 MB at 8 slots).
  logits = jax.lax.optimization_barrier(logits)
  padded = jnp.pad(logits, ((0, 0), (0, nb * BLOCK - v)), constant_values=-jnp.inf)
  return sample_blocked(padded.reshape(b, nb, BLOCK), keys, temperature)


def sample_blocked(
  logits,  # [B, NB, K] f32: token n * K + k at [:, n, k]
  keys,  # [B] typed PRNG keys
  temperature,  # [B] f32; 0 = greedy
):  # -> ([B] int32 tokens, [B] f32 log-probs under log_softmax(logits / temperature))
  """The unfiltered sampler: an inverse CDF with one uniform per row instead of a Gumbel variate per
  token (which costs a [B, V] array of random bits per step), in four reductions over the logits and
  no [B, V] write. Pass 1 the row max and argmax (greedy rows), pass 2 the blocks' sums of
  exp(z - max) (their total gives logsumexp(z)); then the block where the uniform falls; pass 3 that
  block's K logits, picked by a masked max over the blocks (a gather of one block per row made XLA
  TPU relay out the whole array); within them the token. Only tokens of nonzero probability can be
  drawn (float rounding at a boundary falls back to the block's last such token)."""
  t = jnp.where(temperature > 0, temperature, 1.0)[:, None, None]
  z = logits.astype(jnp.float32) / t
  b, nb, k = z.shape
  m = jnp.max(z, axis=(1, 2))
  greedy = jnp.argmax(z.reshape(b, nb * k), axis=-1)
  cum = jnp.cumsum(jnp.sum(jnp.exp(z - m[:, None, None]), axis=-1), axis=-1)  # [B, NB]
  total = cum[:, -1]
  r = (1.0 - jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)) * total
  blk = jnp.argmax(cum >= r[:, None], axis=-1)  # the first block whose cumulative mass reaches r
  before = jnp.where(
    blk > 0, jnp.take_along_axis(cum, jnp.maximum(blk - 1, 0)[:, None], 1)[:, 0], 0
  )
  mine = jnp.arange(nb)[None, :, None] == blk[:, None, None]
  zb = jnp.max(jnp.where(mine, z, -jnp.inf), axis=1)  # [B, K]: the block's logits
  within = jnp.exp(zb - m[:, None])
  hit = (jnp.cumsum(within, axis=-1) >= (r - before)[:, None]) & (within > 0)
  last = k - 1 - jnp.argmax((within > 0)[:, ::-1], axis=-1)
  idx = jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last)
  drawn = temperature > 0
  tokens = jnp.where(drawn, blk * k + idx, greedy).astype(jnp.int32)
  chosen = jnp.where(drawn, jnp.take_along_axis(zb, idx[:, None], axis=-1)[:, 0], m)
  return tokens, chosen - (m + jnp.log(total))


def filters(top_k, top_p, vocab_size: int) -> bool:
  """Host side: whether any row's settings restrict its distribution (the `filtered` flag)."""
  return bool(np.any(_filtered(vocab_size, np.asarray(top_k), np.asarray(top_p))))


def token_keys(
  base_keys,  # [B] typed keys: fold_in(key(seed), sample_index) per row
  steps,  # [B] int32: index of the token being drawn within the completion
):  # -> [B] typed keys
  return jax.vmap(jax.random.fold_in)(base_keys, steps)


def sample_base_keys(
  seeds, sample_indices
):  # [B] int, [B] int -> [B] typed keys (host-side inputs)
  return _base_keys(jnp.asarray(seeds, jnp.uint32), jnp.asarray(sample_indices, jnp.int32))


@jax.jit  # one dispatch: run eagerly, the vmapped fold_in was ~4 ms of host time per decode chunk
def _base_keys(seeds, sample_indices):  # [B] uint32, [B] int32 -> [B] typed keys
  return jax.vmap(lambda s, j: jax.random.fold_in(jax.random.key(s), j))(seeds, sample_indices)
