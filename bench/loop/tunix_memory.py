"""Tunix's GRPO and PPO train steps, compiled with its own loss and with ours: does it fit one chip?

``python -m bench.loop.tunix_memory [--algo grpo ppo] [--backend cpu|tpu] [--models ...] [--tokens ...]
[--out FILE]`` compiles (never runs) tunix's actor train step — ``PeftTrainer._train_step``'s body:
``nnx.value_and_grad`` of the policy loss over every parameter, ``optax.global_norm`` of the
gradients, an SGD update of the donated parameters — on tunix's own model configs (bf16 parameters
and compute, per-block remat), once per policy loss:

* GRPO (``--algo grpo``): Qwen2.5-1.5B and Qwen3-4B at 8k and 32k completion tokens per
  micro-batch (4096 + 512 prompt per sequence), tunix's ``"grpo"`` against ours from the logits
  (``"grpo_kernels"``) and the fused LM-head loss (``"grpo_kernels_fused"``), for one v6e chip.
* PPO (``--algo ppo``): Qwen3-4B for one chip of a v4-8 at the seed-002 shape (one prompt x 2
  samples, 256 prompt + 128 completion tokens each) and with 4096-token completions (512 prompt),
  tunix's ``"ppo"`` against ``"ppo_kernels"`` and ``"ppo_kernels_fused"``, with PPOConfig's
  defaults and with the entropy bonus (``entropy_coef=0.01``, which tunix computes from the full
  f32 logits).

From each compiled executable, XLA's memory analysis: arguments, temporaries, and the peak
(arguments + outputs - aliased + temporaries). On ``--backend tpu`` (needs libtpu in the tunix
environment: ``pip install "jax[tpu]==0.10.2"``; run with ``ALLOW_MULTIPLE_LIBTPU_LOAD=1
JAX_PLATFORMS=cpu``) the step is compiled deviceless with tunix's flash (splash) attention and
compared with the chip's HBM; on CPU with dense attention (tunix's CPU path: its [B, H, L, L] scores
dominate the temporaries). Every figure is *compiled*: nothing is measured. Each compile runs in its
own subprocess (a 4B compile holds several GiB of host memory; ``--jobs`` of them at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

GiB = 2**30
MODELS = {"qwen2.5-1.5b": ("qwen2", "qwen2p5_1p5b"), "qwen3-4b": ("qwen3", "qwen3_4b")}
TOKENS = (8192, 32768)
LOSSES = {
  "grpo": ("grpo", "grpo_kernels", "grpo_kernels_fused"),
  "ppo": ("ppo", "ppo_kernels", "ppo_kernels_fused"),
}
COMPLETION, PROMPT = 4096, 512  # GRPO, per sequence; micro-batch = tokens / COMPLETION sequences
# PPO on one chip of a v4-8 with Qwen3-4B: seed 002's shape (Tunix GRPO GSM8K: batch 1 x 2
# generations, prompt 256, 128 new tokens; ../shared/seed-runs.md and its runner's defaults) and the
# same two sequences with 4096-token completions (the GRPO table's 8k tokens per micro-batch)
PPO_MODEL, PPO_CHIP = "qwen3-4b", "v4"
PPO_SHAPES = ((2, 256, 128), (2, 512, 4096))  # (sequences, prompt, completion)
PPO_ENTROPY = (None, 0.01)  # PPOConfig's default (no bonus) and an entropy bonus
FLASH_BLOCKS = (512, 256, 128)  # splash attention's block: the largest dividing prompt + completion


@dataclasses.dataclass(frozen=True)
class Case:
  model: str
  tokens: int  # completion tokens per micro-batch
  loss: str
  backend: str  # "cpu" | "tpu"
  chip: str = "v6e"  # the TPU generation compiled for (one chip)
  completion: int = COMPLETION  # tokens per sequence
  prompt: int = PROMPT
  entropy_coef: float | None = None  # PPO only

  @property
  def algo(self) -> str:
    return "ppo" if self.loss.startswith("ppo") else "grpo"


def _model(case: Case):
  """The abstract tunix model (no parameters allocated), bf16, per-block remat."""
  import importlib

  import jax.numpy as jnp
  from flax import nnx

  module_name, ctor = MODELS[case.model]
  mod = importlib.import_module(f"tunix.models.{module_name}.model")
  cfg = getattr(mod.ModelConfig, ctor)()
  cfg = dataclasses.replace(
    cfg,
    dtype=jnp.bfloat16,
    param_dtype=jnp.bfloat16,
    remat_config=mod.RematConfig.BLOCK,
    use_flash_attention=case.backend == "tpu",
    flash_attention_block_size=next(
      b for b in FLASH_BLOCKS if not (case.prompt + case.completion) % b
    ),
  )
  cls = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[module_name]
  return nnx.eval_shape(lambda: getattr(mod, cls)(cfg, rngs=nnx.Rngs(0)))


def _example(case: Case):
  """The abstract train example: GRPO's ([B] advantages) or PPO's ([B, T] GAE advantages)."""
  import jax
  import jax.numpy as jnp
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.ppo import ppo_learner

  b, p, t = case.tokens // case.completion, case.prompt, case.completion
  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  ppo = case.algo == "ppo"
  return (ppo_learner if ppo else grpo_learner).TrainExample(
    prompt_ids=s((b, p), jnp.int32),
    prompt_mask=s((b, p), jnp.bool_),
    completion_ids=s((b, t), jnp.int32),
    completion_mask=s((b, t), jnp.int32),
    advantages=s((b, t) if ppo else (b,), jnp.float32),
    ref_per_token_logps=s((b, t), jnp.float32),
    old_per_token_logps=s((b, t), jnp.float32),
  )


def _algo_config(case: Case):
  """tunix's config of the case: GRPOConfig (beta 0.04) or PPOConfig (defaults, entropy_coef)."""
  if case.algo == "ppo":
    from tunix.rl.ppo import ppo_learner

    return ppo_learner.PPOConfig(entropy_coef=case.entropy_coef)
  from tunix.rl.grpo import grpo_learner

  cfg = grpo_learner.GRPOConfig(num_generations=2, beta=0.04)
  cfg.temperature = 1.0  # the learner sets it from the rollout config
  return cfg


def train_step(loss_name: str, graph, algo_config, pad_id: int = 0, eos_id: int = 1):
  """tunix's PeftTrainer._train_step body as a pure function of (params, rest, example)."""
  import jax
  import optax
  from flax import nnx
  from tunix.rl import function_registry

  loss_fn = function_registry.get_policy_loss_fn(loss_name)

  def step(params, rest, example):
    model = nnx.merge(graph, params, rest)
    grad_fn = nnx.value_and_grad(
      lambda m: loss_fn(m, example, algo_config, pad_id, eos_id), has_aux=True
    )
    (loss, aux), grads = grad_fn(model)
    norm = optax.global_norm(grads)
    new = jax.tree.map(lambda p, g: (p - 1e-6 * g).astype(p.dtype), params, grads)
    return new, loss, aux, norm

  return step


def compile_case(case: Case) -> dict:
  """Compile one case (in this process); the memory analysis in bytes."""
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh

  from kernels import backend
  from kernels.integrations import tunix as grpo_tunix

  grpo_tunix.register()  # impl "auto": the kernels under the TPU target, the references on CPU
  if case.backend == "tpu":
    devs = backend.tpu_devices(case.chip)[:1]  # one chip (a v4 chip is one megacore device)
    ctx = backend.use_target("tpu", interpret=False, generation=case.chip)
  else:
    devs = jax.devices("cpu")[:1]
    ctx = backend.use_target("cpu")
  mesh = Mesh(np.array(devs).reshape(1, 1), ("fsdp", "tp"))
  with ctx, mesh:  # tunix reads the mesh from the legacy `with mesh:` context
    graph, params, rest = nnx.split(_model(case), nnx.Param, ...)
    step = train_step(case.loss, graph, _algo_config(case))
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(devs[0]))  # fmt: skip
    args = jax.tree.map(place, (params, rest, _example(case)))
    try:
      compiled = jax.jit(step, donate_argnums=(0,)).trace(*args).lower().compile()
    except jax.errors.JaxRuntimeError as e:
      # the TPU compiler refuses a program whose temporaries exceed the chip's HBM: that is the
      # answer (does not fit), with the temporaries it needed
      found = re.search(r"HLO temporaries \(([\d.]+)G\)", str(e))
      if "RESOURCE_EXHAUSTED" not in str(e) or not found:
        raise
      return dict(oom=True, temp=int(float(found.group(1)) * GiB))
  mem = compiled.memory_analysis()
  out = dict(
    argument=mem.argument_size_in_bytes,
    output=mem.output_size_in_bytes,
    alias=mem.alias_size_in_bytes,
    temp=mem.temp_size_in_bytes,
  )
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def _run_subprocess(case: Case, timeout: int) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if case.backend == "tpu":
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  cmd = [
    sys.executable,
    "-m",
    "bench.loop.tunix_memory",
    "--one",
    json.dumps(dataclasses.asdict(case)),
  ]
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(dataclasses.asdict(case), error=f"compile exceeded {timeout} s")
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return dict(dataclasses.asdict(case), error=" | ".join(tail))
  return dict(dataclasses.asdict(case), **json.loads(lines[-1]))


def _key(row: dict, algo: str) -> tuple:
  """The table row a result belongs to: GRPO (model, tokens, backend), PPO adds its shape and the
  entropy bonus."""
  base = (row["model"], row["tokens"], row["backend"])
  if algo == "grpo":
    return base
  return (*base, row.get("completion", COMPLETION), row.get("prompt", PROMPT), row.get("entropy_coef"))  # fmt: skip


def _cell(r: dict | None, backend: str, hbm: int) -> str:
  if r is None or "error" in r:
    return "error" if r else "-"
  if r.get("oom"):  # the compiler refused it: temporaries alone exceed the HBM
    return f"**does not fit** (temp {r['temp'] / GiB:.1f} > {hbm / GiB:.2f})"
  fits = "" if backend != "tpu" else (" fits" if r["peak"] <= hbm else " **does not fit**")
  return f"{r['peak'] / GiB:.1f} GiB ({r['temp'] / GiB:.1f}){fits}"


def table(rows: list[dict], algo: str = "grpo") -> str:
  """Markdown: one row per model / shape / backend, a column per loss (peak GiB, temp GiB), each
  TPU cell against its chip's HBM (kernels.tpu_targets, as the compiler reports it)."""
  from kernels import tpu_targets

  losses = LOSSES[algo]
  rows = [r for r in rows if r["loss"] in losses]
  cols = (
    "completion tokens" if algo == "grpo" else "sequences x (prompt + completion) | entropy_coef"
  )
  head = f"| model | {cols} | backend | " + " | ".join(f"{x} peak (temp)" for x in losses)
  lines = [head + " |", "|---" * head.count("|") + "|"]  # a "|" before each column
  order = lambda key: tuple(-1 if x is None else x for x in key)  # no entropy bonus first
  for key in sorted({_key(r, algo) for r in rows}, key=order):
    chip = next(r.get("chip", "v6e") for r in rows if _key(r, algo) == key)
    hbm = tpu_targets.generation(chip).hbm_bytes
    found = {r["loss"]: r for r in rows if _key(r, algo) == key}
    cells = [_cell(found.get(loss), key[2], hbm) for loss in losses]
    backend = key[2] if key[2] != "tpu" else f"tpu ({chip})"
    if algo == "grpo":
      shape = f"{key[1] // 1024}k"
    else:
      shape = (
        f"{key[1] // key[3]} x ({key[4]} + {key[3]}) | {key[5] if key[5] is not None else '-'}"
      )
    lines.append(f"| {key[0]} | {shape} | {backend} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def bench_suite(out_dir) -> int:
  """`python -m bench --suite tunix`: both tables (GRPO: both models, both token counts, every
  loss, one v6e chip; PPO: both shapes, both entropy options, every loss, one v4 chip) where libtpu
  is installed, else XLA:CPU's, its rows written to OUT_DIR/tunix_memory.json as they compile."""
  import importlib.util

  from kernels import tpu_targets

  if importlib.util.find_spec("tunix") is None:
    raise SystemExit(
      '--suite tunix needs google-tunix: pip install -e ".[tunix]" (nox -s tunix builds one)'
    )
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  target = "tpu" if tpu_targets.libtpu_available() else "cpu"
  return main(["--backend", target, "--out", str(out / "tunix_memory.json")])


def cases(algos, backends, models, tokens) -> list[Case]:
  """GRPO: every model x token count x loss; PPO: every shape x entropy option x loss."""
  out = []
  for b in backends:
    if "grpo" in algos:
      out += [Case(m, t, loss, b) for m in models for t in tokens for loss in LOSSES["grpo"]]
    if "ppo" in algos:
      out += [
        Case(PPO_MODEL, n * t, loss, b, PPO_CHIP, t, p, e)
        for n, p, t in PPO_SHAPES
        for e in PPO_ENTROPY
        for loss in LOSSES["ppo"]
      ]
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--algo", nargs="+", choices=sorted(LOSSES), default=sorted(LOSSES))
  p.add_argument("--backend", choices=("cpu", "tpu"), nargs="+", default=["cpu", "tpu"])
  p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
  p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="GRPO only")
  p.add_argument("--jobs", type=int, default=1, help="compiles at once (each a subprocess)")
  p.add_argument("--timeout", type=int, default=1800, help="seconds per compile")
  p.add_argument("--out", help="write the rows as JSON here")
  p.add_argument("--one", help=argparse.SUPPRESS)  # a Case as JSON: compile it in this process
  args = p.parse_args(argv)
  if args.one:
    print(json.dumps(compile_case(Case(**json.loads(args.one)))), flush=True)
    return 0
  for tokens in args.tokens:
    if tokens % COMPLETION:
      p.error(f"--tokens must be multiples of {COMPLETION} (completion tokens per sequence)")
  todo = cases(args.algo, args.backend, args.models, args.tokens)
  with ThreadPoolExecutor(args.jobs) as pool:
    rows = []
    for row in pool.map(lambda c: _run_subprocess(c, args.timeout), todo):
      rows.append(row)
      print(json.dumps(row), flush=True)
      if args.out:  # after every compile, whole or not at all: a stopped run keeps its rows
        from bench.report import write_atomic

        write_atomic(pathlib.Path(args.out), json.dumps(rows, indent=1))
  for algo in args.algo:
    print(table(rows, algo))
  return 0


if __name__ == "__main__":
  sys.exit(main())
