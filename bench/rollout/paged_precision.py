"""Why the paged engine's bf16 log-probs were further from the trainer's than the dense engine's (issue
18), measured: the same model and requests through the paged engine with three decode attentions.

    python -m bench.rollout.paged_precision            # bf16 and f32, the rollout bench's small CPU workload
    python -m bench.rollout.paged_precision --pallas   # also the Pallas kernel (CPU: the interpreter, slow)

  * "model attention": the fix, what attn_impl "xla" (and "auto" on CPU) runs: the model's `rl.model.cache.attention`
    over the gathered pages (softmax in f32, probabilities rounded to the compute dtype, then PV);
  * "kernel xla reference": what the engine ran before: `kernels.paged_attention(impl="xla")`, whose
    probabilities and V stay f32 for the PV product;
  * "pallas kernel": the paged kernel TPU / GPU run (online softmax; unnormalised probabilities
    rounded to the compute dtype).
Each against the trainer's teacher-forced forward (`rl.update.token_logps`: the mean and max |diff| in
nats over every sampled token) and, greedy, the fraction of completions equal to the dense engine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import numpy as np

from bench.mismatch import trainer_logps
from bench.rollout.parity import greedy_agreement
from bench.rollout.throughput import SIZES, bench_engine, workload
from rl.model import init_model, preset, scale_weights
from rl.rollout.paged import PagedEngine
from rl.rollout.paged_cache import PYTREE_FIELDS, PagedKVCache


@dataclasses.dataclass(frozen=True)
class KernelReferenceCache(PagedKVCache):
  """The paged cache as it decoded before the fix: `kernels.paged_attention` even for impl "xla"."""

  @property
  def model_attention(self) -> bool:
    return False


jax.tree_util.register_dataclass(KernelReferenceCache, **PYTREE_FIELDS)


class KernelReferenceEngine(PagedEngine):
  def _new_cache(self) -> PagedKVCache:
    c = super()._new_cache()
    # Every field carried over (a new cache field is not silently dropped), attn_impl forced to "xla".
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    return KernelReferenceCache(**(fields | {"attn_impl": "xla"}))


VARIANTS = ("model attention", "kernel xla reference", "pallas kernel")


def engine(model, variant: str):
  config = bench_engine(model, "small", "paged").config
  if variant == "model attention":  # "xla": also on TPU / GPU, where "auto" is the kernel
    return PagedEngine(model, dataclasses.replace(config, attn_impl="xla"), eos_ids=[])
  if variant == "pallas kernel":
    return PagedEngine(model, dataclasses.replace(config, attn_impl="pallas"), eos_ids=[])
  return KernelReferenceEngine(model, config, eos_ids=[])


def run(variants=VARIANTS[:2], dtypes=("bfloat16", "float32")) -> list[dict]:
  size = SIZES["small"]
  rows = []
  prompts, params = workload(size, "fixed")
  greedy = [dataclasses.replace(p, temperature=0.0) for p in params]
  for dtype in dtypes:
    model = scale_weights(init_model(preset(size["model"], dtype=dtype), seed=0), 10.0)
    dense = bench_engine(model, "small", "dense").generate(prompts, greedy)
    for variant in variants:
      eng = engine(model, variant)
      res = eng.generate(prompts, params)
      plain, _ = trainer_logps(model, res, size, 0, 1.0)
      _, mask, sampler = res.padded(size["new_tokens"])
      diff = np.abs(plain - sampler)[mask]
      same = greedy_agreement(eng.generate(prompts, greedy), dense)
      rows.append(dict(dtype=dtype, decode=variant, mean=diff.mean(), max=diff.max(), greedy=same))
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m bench.rollout.paged_precision", description=__doc__.split("\n")[0]
  )
  p.add_argument("--pallas", action="store_true", help="also the Pallas kernel (CPU: interpreter)")
  a = p.parse_args(argv)
  rows = run(VARIANTS if a.pallas else VARIANTS[:2])
  print("| dtype | paged decode attention | mean abs(dlogp) vs trainer | max | greedy = dense |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['dtype']} | {r['decode']} | {r['mean']:.2g} | {r['max']:.2g} | {100 * r['greedy']:.0f}% |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
