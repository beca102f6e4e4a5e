"""Token sampling on device: temperature, top-k, top-p, min-p, greedy, each row with its own settings
and key.

Returns the log-probability of the drawn token under the distribution it was drawn from, and its
**support gap** (kernels.support): g = t - z_y <= 0 with t the kept set's threshold, taken halfway
between its smallest z and the largest z it drops (`gap_of`), -inf where the row filters nothing and
at temperature 0. A trainer that scores y over S = {v : z'_v >= z'_y + g} scores
it under the distribution it was drawn from (truncation-exact log-probs, docs/rollout.md).

The distribution (`processed_logprobs`), per row, with z = logits / temperature (temperature 0: z =
logits, and the token is the argmax). The kept set is a **threshold set**, {v : z_v >= tau}: a token
tied with the last kept one is kept (as Hugging Face's and vLLM's top-k keep it), so the set is a
function of the logits alone and the gap reproduces it exactly. tau = max(tau_k, tau_p, tau_m):
  * top-k (k > 0): tau_k = the k-th largest z (with ties, more than k tokens are kept); k >= V is off.
  * top-p (p < 1): order the tokens z >= tau_k by z, descending; q = softmax over them (the whole
    vocabulary when top-k is off); the nucleus is each token whose mass *before* it, the sum of q over
    the tokens ranked above it, is < p (the top token always); tau_p = the z of its last token.
    p = 1 is off.
  * min-p (m > 0): tau_m = max z + log(m), i.e. p_v >= m * p_max (the renormalisation of the other
    filters leaves the ratio unchanged). m = 0 is off.
  * the result is log_softmax(z) renormalised over the kept set (-inf outside it).
The kept set is the intersection of the filters; top-p reads the top-k set's softmax (HF and vLLM
apply top-k first), min-p commutes with both. `processed_logprobs_sorted` computes the thresholds from
one descending sort of the vocabulary (the reference); the sampler finds the same thresholds without
sorting:
  * no filter in the batch (the GRPO default): log_softmax(z) alone, no sort, no top-k;
  * otherwise `lax.top_k` over a bounded candidate set of the `candidates` largest z per row. The
    thresholds are exact when every filtered row's can be read off its candidates: k <= candidates,
    or top-k off and the candidates' mass already reaches p (the nucleus ends inside them); min-p
    needs only the max. Only when some row fails that (top_k > candidates, or a nucleus wider than
    the candidates on a flat distribution) does the batch fall back to the full sort.
The kept set itself is z >= tau over the whole row, so ties past the candidates are kept too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels import support

CANDIDATES = (
  64  # the bounded candidate set of top-k / top-p: lax.top_k width before a fallback sort
)


def _scaled(logits, temperature):  # [B, V], [B] -> [B, V] f32 logits / temperature (greedy: / 1)
  t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
  return logits.astype(jnp.float32) / t


def _filtered(
  v: int, top_k, top_p, min_p
):  # [B] x3 -> [B] bool: the row restricts its distribution
  return ((top_k > 0) & (top_k < v)) | (top_p < 1.0) | (min_p > 0.0)


def _thresholds(
  z,  # [B, V] f32 scaled logits
  vals,  # [B, C] f32: the C largest z per row, descending (C = V: the sorted row)
  top_k,  # [B] int32; 0 = off
  top_p,  # [B] f32; 1 = off
  min_p,  # [B] f32; 0 = off
):  # -> ([B] f32 tau, [B] bool: the C values determine tau exactly)
  """The kept set's threshold tau (module docstring) from the rows' largest values, and whether
  `vals` hold every value it depends on. -inf: the row filters nothing."""
  v, c = z.shape[-1], vals.shape[-1]
  k = jnp.where((top_k > 0) & (top_k < v), top_k, v)  # [B]; v: off
  kth = jnp.take_along_axis(vals, jnp.clip(k - 1, 0, c - 1)[:, None], axis=-1)[:, 0]
  tau_k = jnp.where(k < v, kth, -jnp.inf)
  # top-p reads the softmax over the top-k set {z >= tau_k}, normalised over the whole row (ties
  # past the candidates included; a sort of the row is not needed for a sum)
  in_k = z >= tau_k[:, None]
  lse_k = jax.nn.logsumexp(jnp.where(in_k, z, -jnp.inf), axis=-1, keepdims=True)
  q = jnp.where(vals >= tau_k[:, None], jnp.exp(vals - lse_k), 0.0)  # [B, C]
  mass_before = jnp.cumsum(q, axis=-1) - q
  rank = jnp.arange(c)[None, :]
  nucleus = (vals >= tau_k[:, None]) & ((mass_before < top_p[:, None]) | (rank == 0))
  tau_p = jnp.min(jnp.where(nucleus, vals, jnp.inf), axis=-1)  # the nucleus's last value
  tau_p = jnp.where(top_p < 1.0, tau_p, -jnp.inf)
  tau_m = vals[:, 0] + jnp.log(min_p)  # log 0 = -inf: off
  tau = jnp.maximum(jnp.maximum(tau_k, tau_p), tau_m)
  # Exact when nothing tau depends on lies past the candidates: the k-th value is among them, and
  # the nucleus ends inside them (top-p off, top-k inside, or the candidates' mass reaches p).
  k_ok = (k >= v) | (k <= c)
  p_ok = (top_p >= 1.0) | (k <= c) | (jnp.sum(q, axis=-1) >= top_p)
  return tau, k_ok & p_ok


def _restricted(z, tau):  # [B, V], [B] -> [B, V] log_softmax of z over {z >= tau}, -inf outside
  kept = jnp.where(z >= tau[:, None], z, -jnp.inf)
  return kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True)


def sorted_threshold(
  z,  # [B, V] f32 scaled logits
  top_k,  # [B] int32
  top_p,  # [B] f32
  min_p,  # [B] f32
):  # -> [B] f32 tau (-inf: keeps every token)
  """tau from one descending sort of the whole row (always exact): the reference and the fallback."""
  zs = -jnp.sort(-z, axis=-1)
  return _thresholds(z, zs, top_k, top_p, min_p)[0]


def candidate_threshold(
  z,  # [B, V] f32 scaled logits
  top_k,  # [B] int32
  top_p,  # [B] f32
  min_p,  # [B] f32
  candidates: int = CANDIDATES,
):  # -> ([B] f32 tau, [B] bool: exact for the row)
  """tau from the `candidates` largest z of each row (`lax.top_k`, no sort of the vocabulary), and
  whether it provably equals the sorted definition's for that row."""
  vals, _ = jax.lax.top_k(z, min(candidates, z.shape[-1]))  # [B, C] descending
  return _thresholds(z, vals, top_k, top_p, min_p)


def kept_threshold(
  z,  # [B, V] f32 scaled logits
  top_k,  # [B] int32; 0 = off
  top_p,  # [B] f32; 1 = off
  min_p,  # [B] f32; 0 = off
  candidates: int = CANDIDATES,
):  # -> [B] f32 tau: the row keeps {v : z_v >= tau}; -inf where it filters nothing
  """The kept set's threshold of every row (module docstring); sorts the vocabulary only when a
  bounded candidate set cannot give the exact answer, and does nothing when no row filters."""
  filtered = _filtered(z.shape[-1], top_k, top_p, min_p)

  def restrict():
    tau, exact = candidate_threshold(z, top_k, top_p, min_p, candidates)
    tau = jax.lax.cond(
      jnp.all(exact | ~filtered), lambda: tau, lambda: sorted_threshold(z, top_k, top_p, min_p)
    )
    return jnp.where(filtered, tau, -jnp.inf)

  return jax.lax.cond(jnp.any(filtered), restrict, lambda: jnp.full(z.shape[:1], -jnp.inf))


def processed_logprobs_sorted(
  logits,  # [B, V] f32
  temperature,  # [B] f32; 0 = greedy (plain softmax)
  top_k,  # [B] int32; 0 = off
  top_p,  # [B] f32; 1 = off
  min_p,  # [B] f32; 0 = off
):  # -> [B, V] f32 log-probs, -inf outside the kept set
  """The reference definition: the thresholds from one descending sort of the vocabulary."""
  z = _scaled(logits, temperature)
  tau = sorted_threshold(z, top_k, top_p, min_p)
  return _restricted(z, jnp.where(_filtered(z.shape[-1], top_k, top_p, min_p), tau, -jnp.inf))


def processed_logprobs(
  logits,  # [B, V] f32
  temperature,  # [B] f32; 0 = greedy (plain softmax)
  top_k,  # [B] int32; 0 = off
  top_p,  # [B] f32; 1 = off
  min_p,  # [B] f32; 0 = off
  candidates: int = CANDIDATES,
):  # -> [B, V] f32 log-probs, -inf outside the kept set
  """The log-softmax of logits / temperature restricted to the kept set (the module docstring
  gives the exact semantics)."""
  z = _scaled(logits, temperature)
  return _restricted(z, kept_threshold(z, top_k, top_p, min_p, candidates))


def gap_of(
  z,  # [B, V] f32 scaled logits
  tau,  # [B] f32 the kept set's threshold (-inf: nothing filtered)
  ids,  # [B] int: the token scored, inside the kept set
):  # -> [B] f32 support gap <= 0, -inf where tau is -inf
  """g = t - z_y with t halfway between the smallest kept z and the largest dropped one (the
  smallest kept z when nothing finite was dropped): on these logits S = {v : z_v >= z_y + g} is
  exactly the kept set, and a trainer whose logits differ from the sampler's by rounding keeps the
  same set (with t = the smallest kept z itself, the boundary token would drop out of S whenever its
  logit rounded below z_y's shift: half the time). Lowered by an ulp where the trainer's f32
  threshold z_y + g (kernels.support.threshold) would round above the smallest kept z. Clipped to 0
  when y lies outside the kept set (the trainer-side replay on logits that round otherwise: S keeps
  y and what is above it)."""
  kept = z >= tau[:, None]
  zmin = jnp.min(jnp.where(kept, z, jnp.inf), axis=-1)
  below = jnp.max(jnp.where(kept, -jnp.inf, z), axis=-1)  # the largest dropped z (-inf: none)
  t = jnp.where(below > -jnp.inf, zmin * 0.5 + below * 0.5, zmin)
  zy = jnp.take_along_axis(z, ids[:, None].astype(jnp.int32), axis=-1)[:, 0]
  g = jnp.minimum(t - zy, 0.0)
  for _ in range(2):  # one ulp suffices unless |g| is far below ulp(zmin); a second for safety
    g = jnp.where(support.threshold(zy, g) > zmin, jnp.nextafter(g, -jnp.inf), g)
  return jnp.where((tau == -jnp.inf) | (zmin == -jnp.inf), -jnp.inf, g)


def support_gaps(
  logits,  # [N, V] f32: the scoring model's logits
  ids,  # [N] int: the sampled tokens
  temperature,  # [N] f32 (0: greedy, no gap)
  top_k,  # [N] int32
  top_p,  # [N] f32
  min_p,  # [N] f32
):  # -> [N] f32 support gaps (-inf: unfiltered row or temperature 0)
  """The sampler's filter rule applied to `logits` (the kept set `sample` draws from) and the gap of
  each id in it: what the engines report, and what the trainer replays on its own old-policy
  logits for an engine that cannot report gaps (sglang_jax)."""
  z = _scaled(logits, temperature)
  gap = gap_of(z, kept_threshold(z, top_k, top_p, min_p), ids)
  return jnp.where(temperature > 0, gap, -jnp.inf)


def sample(
  logits,  # [B, V] f32
  keys,  # [B] typed PRNG keys
  temperature,  # [B] f32
  top_k,  # [B] int32
  top_p,  # [B] f32
  min_p,  # [B] f32
  filtered: bool
  | None = None,  # static: some row filters; False: none does; None: decide on device
):  # -> ([B] int32 tokens, [B] f32 log-probs, [B] f32 support gaps)
  """Draw one token per row (temperature 0: the argmax), its log-prob under the distribution it
  was drawn from and its support gap (-inf: the row filters nothing, or is greedy).
  `filtered=False` (the caller knows no row filters, the GRPO default) compiles only the plain pass:
  no top-k candidates and no fallback sort in the program at all."""
  if filtered is False:
    return (*sample_plain(logits, keys, temperature), no_gaps(logits.shape[0]))
  z = _scaled(logits, temperature)
  tau = kept_threshold(z, top_k, top_p, min_p)
  logp = _restricted(z, tau)
  drawn = jax.vmap(jax.random.categorical)(keys, logp)
  greedy = jnp.argmax(logits, axis=-1)
  hot = temperature > 0
  tokens = jnp.where(hot, drawn, greedy).astype(jnp.int32)
  plain = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.where(hot[:, None], logp, plain)
  gaps = jnp.where(hot, gap_of(z, tau, tokens), -jnp.inf)
  return tokens, jnp.take_along_axis(chosen, tokens[:, None], axis=-1)[:, 0], gaps


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


def no_gaps(n: int):  # -> [n] f32 -inf: the support gaps of rows that filter nothing
  return jnp.full((n,), -jnp.inf, jnp.float32)


def filters(top_k, top_p, min_p, vocab_size: int) -> bool:
  """Host side: whether any row's settings restrict its distribution (the `filtered` flag)."""
  return bool(
    np.any(_filtered(vocab_size, np.asarray(top_k), np.asarray(top_p), np.asarray(min_p)))
  )


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
