"""Tunix's GRPO train step, compiled with its own loss and with ours: does it fit one chip?

``python -m bench.loop.tunix_memory [--backend cpu|tpu] [--models ...] [--tokens ...] [--out FILE]``
compiles (never runs) tunix's train step — ``PeftTrainer._train_step``'s body: ``nnx.value_and_grad``
of the policy loss over every parameter, ``optax.global_norm`` of the gradients, an SGD update of
the donated parameters — for Qwen2.5-1.5B and Qwen3-4B (tunix's own model configs, bf16 parameters
and compute, per-block remat) at 8k and 32k completion tokens per micro-batch, once per policy
loss: tunix's ``"grpo"``, ours from the logits (``"grpo_kernels"``) and the fused LM-head loss
(``"grpo_kernels_fused"``). From each compiled executable, XLA's memory analysis: arguments,
temporaries, and the peak (arguments + outputs - aliased + temporaries). On ``--backend tpu`` (needs
libtpu: ``ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu``) the step is compiled deviceless for one
v6e chip with tunix's flash (splash) attention and compared with the chip's 31.25 GiB; on CPU with
dense attention (tunix's CPU path: its [B, H, L, L] scores dominate the temporaries). Every figure
is *compiled*: nothing is measured. Each compile runs in its own subprocess (a 4B compile holds
several GiB of host memory; ``--jobs`` of them at once).
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
LOSSES = ("grpo", "grpo_kernels", "grpo_kernels_fused")
COMPLETION, PROMPT = 4096, 512  # per sequence; micro-batch = tokens / COMPLETION sequences
FLASH_BLOCK = 512  # divides PROMPT + COMPLETION


@dataclasses.dataclass(frozen=True)
class Case:
  model: str
  tokens: int  # completion tokens per micro-batch
  loss: str
  backend: str  # "cpu" | "tpu"


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
    flash_attention_block_size=FLASH_BLOCK,
  )
  cls = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[module_name]
  return nnx.eval_shape(lambda: getattr(mod, cls)(cfg, rngs=nnx.Rngs(0)))


def _example(b: int):
  import jax
  import jax.numpy as jnp
  from tunix.rl.grpo import grpo_learner

  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  return grpo_learner.TrainExample(
    prompt_ids=s((b, PROMPT), jnp.int32),
    prompt_mask=s((b, PROMPT), jnp.bool_),
    completion_ids=s((b, COMPLETION), jnp.int32),
    completion_mask=s((b, COMPLETION), jnp.int32),
    advantages=s((b,), jnp.float32),
    ref_per_token_logps=s((b, COMPLETION), jnp.float32),
    old_per_token_logps=s((b, COMPLETION), jnp.float32),
  )


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
  from tunix.rl.grpo import grpo_learner

  from kernels import backend
  from kernels.integrations import tunix as grpo_tunix

  grpo_tunix.register()  # impl "auto": the kernels under the TPU target, the references on CPU
  if case.backend == "tpu":
    devs = backend.tpu_devices("v6e-1")
    ctx = backend.use_target("tpu", interpret=False, generation="v6e")
  else:
    devs = jax.devices("cpu")[:1]
    ctx = backend.use_target("cpu")
  mesh = Mesh(np.array(devs).reshape(1, 1), ("fsdp", "tp"))
  with ctx, mesh:  # tunix reads the mesh from the legacy `with mesh:` context
    graph, params, rest = nnx.split(_model(case), nnx.Param, ...)
    cfg = grpo_learner.GRPOConfig(num_generations=2, beta=0.04)
    cfg.temperature = 1.0  # the learner sets it from the rollout config
    step = train_step(case.loss, graph, cfg)
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(devs[0]))  # fmt: skip
    args = jax.tree.map(place, (params, rest, _example(case.tokens // COMPLETION)))
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


def table(rows: list[dict]) -> str:
  """Markdown: one row per model / tokens / backend, a column per loss (peak GiB, temp GiB)."""
  hbm = 31.25 * GiB  # v6e, as the compiler reports it (kernels.tpu_targets)
  head = "| model | completion tokens | backend | " + " | ".join(f"{x} peak (temp)" for x in LOSSES)
  lines = [head + " |", "|---" * (3 + len(LOSSES)) + "|"]
  keys = sorted({(r["model"], r["tokens"], r["backend"]) for r in rows})
  for key in keys:
    cells = []
    for loss in LOSSES:
      r = next((r for r in rows if (r["model"], r["tokens"], r["backend"], r["loss"]) == (*key, loss)), None)  # fmt: skip
      if r is None or "error" in r:
        cells.append("error" if r else "-")
      elif r.get("oom"):  # the compiler refused it: temporaries alone exceed the HBM
        cells.append(f"**does not fit** (temp {r['temp'] / GiB:.1f} > {hbm / GiB:.2f})")
      else:
        fits = "" if key[2] != "tpu" else (" fits" if r["peak"] <= hbm else " **does not fit**")
        cells.append(f"{r['peak'] / GiB:.1f} GiB ({r['temp'] / GiB:.1f}){fits}")
    lines.append(f"| {key[0]} | {key[1] // 1024}k | {key[2]} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def bench_suite(out_dir) -> int:
  """`python -m bench --suite tunix`: the whole table (both models, both token counts, every loss)
  for one v6e chip where libtpu is installed, else XLA:CPU's, its rows written to
  OUT_DIR/tunix_memory.json as they are compiled."""
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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--backend", choices=("cpu", "tpu"), nargs="+", default=["cpu", "tpu"])
  p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
  p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
  p.add_argument("--losses", nargs="+", choices=LOSSES, default=list(LOSSES))
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
  cases = [
    Case(m, t, loss, b)
    for b in args.backend
    for m in args.models
    for t in args.tokens
    for loss in args.losses
  ]
  with ThreadPoolExecutor(args.jobs) as pool:
    rows = []
    for row in pool.map(lambda c: _run_subprocess(c, args.timeout), cases):
      rows.append(row)
      print(json.dumps(row), flush=True)
      if args.out:  # after every compile, whole or not at all: a stopped run keeps its rows
        from bench.report import write_atomic

        write_atomic(pathlib.Path(args.out), json.dumps(rows, indent=1))
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
