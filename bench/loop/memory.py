"""Memory of one update from XLA's memory analysis: GRPO (`rl.update.train_step`) beside PPO with the
value head (`rl.agent.update.update_step`), at any preset's sizes, with no device and nothing allocated.

    python -m bench.loop.memory --preset qwen2.5-0.5b --micro-batch 16 --prompt 256 --completion 768

The update is compiled for the host backend from abstract arrays (`jax.ShapeDtypeStruct`), so the
figures are that backend's buffer assignment (the CPU compiler does not rematerialise): a comparison of
the two updates at the same shapes, and the scale of the activations, not a GPU measurement. One
micro-batch (K = 1) of M rows of P + C tokens; bf16 compute, f32 params, optax AdamW, the fused LM-head
loss. Compiling the 0.5B update takes a few minutes per update on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rl import update
from rl.agent import update as agent
from rl.agent.critic import ValueHead
from rl.model import preset
from rl.model.qwen import Qwen
from rl.optimizer import make_optimizer

GIB = 2**30


def _analyse(fn, args) -> dict:
  t = time.perf_counter()
  m = jax.jit(fn, donate_argnums=(0,)).lower(*args).compile().memory_analysis()
  out = {
    "temp_bytes": m.temp_size_in_bytes,
    "argument_bytes": m.argument_size_in_bytes,
    "output_bytes": m.output_size_in_bytes,
    "alias_bytes": m.alias_size_in_bytes,
    "compile_s": time.perf_counter() - t,
  }
  # Live at once at worst: inputs, the outputs that do not reuse a donated input, and the temporaries.
  out["peak_bytes"] = (
    out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
  )
  return out


def update_memory(
  preset_name: str, micro_batch: int, prompt_len: int, completion_len: int, dtype: str = "bfloat16"
) -> dict[str, dict]:
  """{"grpo": ..., "ppo": ...}: each update's memory analysis (bytes) at these shapes."""
  for name, v in (
    ("micro_batch", micro_batch),
    ("prompt_len", prompt_len),
    ("completion_len", completion_len),
  ):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")
  cfg = preset(preset_name, dtype=dtype, param_dtype="float32")
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  head = nnx.eval_shape(lambda: ValueHead(cfg.hidden_size, rngs=nnx.Rngs(0)))
  head_graphdef, head_params = nnx.split(head, nnx.Param)
  opt = make_optimizer("adamw", 1e-6, 0.0, 1.0, fused=False)
  head_opt = optax.adamw(1e-6)
  opt_state = jax.eval_shape(opt.init, params)
  head_opt_state = jax.eval_shape(head_opt.init, head_params)
  m, c, t = micro_batch, completion_len, prompt_len + completion_len
  spec = jax.ShapeDtypeStruct
  rows = lambda dtype, width: spec((1, m, width), dtype)  # [K = 1, M, width]

  settings = update.LossSettings(completion_len=c, fused_lm_head=True, impl="auto")
  grpo_batch = update.Batch(rows(jnp.int32, t), rows(jnp.bool_, t), spec((1, m), jnp.float32))
  grpo = lambda state, batch: update.train_step(
    graphdef, opt, settings, "grpo", state[0], state[1], batch
  )
  ppo_settings = agent.UpdateSettings(
    completion_len=c,
    algorithm="ppo",
    loss_type="dapo",
    epsilon_low=0.2,
    epsilon_high=0.2,
    temperature=1.0,
    vf_coef=0.1,
    value_clip=0.2,
    impl="auto",
    fused_lm_head=True,
  )
  f32 = lambda: rows(jnp.float32, c)
  ppo_batch = agent.AgentBatch(
    rows(jnp.int32, t), rows(jnp.bool_, t), rows(jnp.bool_, c), f32(), f32(), f32(), f32()
  )
  ppo = lambda state, batch: agent.update_step(
    graphdef, head_graphdef, opt, head_opt, ppo_settings, state, batch
  )
  return {
    "grpo": _analyse(grpo, ((params, opt_state), grpo_batch)),
    "ppo": _analyse(ppo, ((params, head_params, opt_state, head_opt_state), ppo_batch)),
  }


def markdown(result: dict[str, dict]) -> str:
  lines = [
    "| update | temp | arguments | output | aliased | peak | compile |",
    "|---|---|---|---|---|---|---|",
  ]
  names = {
    "grpo": "GRPO, `rl.update.train_step`",
    "ppo": "PPO + value head, `rl.agent.update.update_step`",
  }
  for key, r in result.items():
    g = lambda k, r=r: f"{r[k] / GIB:.2f} GiB"
    lines.append(
      f"| {names[key]} | {g('temp_bytes')} | {g('argument_bytes')} | {g('output_bytes')} | "
      f"{g('alias_bytes')} | {g('peak_bytes')} | {r['compile_s']:.0f} s |"
    )
  extra = result["ppo"]["peak_bytes"] - result["grpo"]["peak_bytes"]
  lines.append(f"\nThe critic's cost: {extra / GIB:+.3f} GiB of peak.")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(
    prog="python -m bench.loop.memory", description=__doc__.split("\n\n")[0]
  )
  ap.add_argument("--preset", default="qwen2.5-0.5b")
  ap.add_argument("--micro-batch", type=int, default=16, help="M: rows per micro-batch")
  ap.add_argument("--prompt", type=int, default=256, help="P: prompt tokens per row")
  ap.add_argument("--completion", type=int, default=768, help="C: completion tokens per row")
  ap.add_argument("--dtype", default="bfloat16", help="compute dtype (params are f32)")
  ap.add_argument("--json", default=None, help="also write the figures (bytes) here")
  args = ap.parse_args(argv)
  result = update_memory(args.preset, args.micro_batch, args.prompt, args.completion, args.dtype)
  print(
    f"{args.preset}, M = {args.micro_batch}, P + C = {args.prompt} + {args.completion}, "
    f"{args.dtype} compute, jax {jax.__version__}, {jax.default_backend()} compile:"
  )
  print(markdown(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "jax": jax.__version__, **result}, f, indent=1)
  return result


if __name__ == "__main__":
  main()
