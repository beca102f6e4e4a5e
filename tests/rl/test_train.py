"""The GRPO loop end to end on the tiny model: metrics written, resume exact, bad configs caught early,
the same numbers on 1 device, 8 simulated devices and 2 processes."""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from rl import cli, train
from rl.configlib import ConfigError
from rl.logging.metrics import read_metrics
from rl.rollout import paged
from rl.rollout.engine import bucket
from rl.run.setup import WIDTH_ALIGN, round_up
from rl.step import step_examples
from tests.compiles import compile_events, compiled_functions, one_device_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Two prompts x two samples, eight new tokens: every code path, seconds per step on CPU.
TINY = [
  "model.preset=tiny",
  "rollout.max_seq_len=192",
  "rollout.max_slots=8",
  "sampling.group_size=2",
  "sampling.max_new_tokens=8",
  "train.prompts_per_step=2",
  "train.micro_batch_size=2",
  "train.learning_rate=1e-3",
  "data.synthetic_train=40",
  "data.synthetic_test=4",
  "eval.batch=2",
  "mesh.fsdp=1",
  "run.progress=false",
]

REQUIRED = [
  "time/train/rollout_s",
  "time/train/reward_s",
  "time/train/update_s",
  "time/train/step_s",
  "time/train/compiles",  # step_avg_last10_s: from the first step that did not compile (below)
  "time/train/compile_s",
  "rollout/tokens_per_s",
  "reward/total/mean",
  "reward/total/std",
  "reward/correct/mean",
  "reward/format/mean",
  "advantage/mean",
  "advantage/std",
  "train/loss",
  "train/clip_fraction",
  "train/kl",
  "train/entropy",
  "train/grad_norm",
  "train/nonfinite_steps",
  "completion/length_mean",
  "mismatch/abs_log_ratio_mean",  # the engine's log-probs against the trainer's (issue 18)
  "mismatch/abs_log_ratio_max",
  "mismatch/k3_kl",
  "mismatch/exp_abs_log_ratio_mean",
  "eval/accuracy",
  "eval_full/accuracy",
  "time/eval_full/step_s",
]


def _run(tmp_path, name, *overrides):
  return train.main(TINY + [f"run.out_dir={tmp_path / name}", *overrides])


def test_two_step_run_writes_every_metric(tmp_path, capsys):
  metrics = _run(
    tmp_path,
    "run",
    "train.steps=2",
    "eval.every=1",
    "train.warmup_sft_steps=2",
    "train.sft_batch_size=6",  # its own batch: 3 micro-batches where a GRPO step has 2
    "train.beta=0.05",
    "train.ppo_epochs=2",
    "train.is_mode=token_truncate",  # the engine's log-probs weight the loss (TIS)
  )
  run_dir = tmp_path / "run"
  lines = read_metrics(str(run_dir))
  grpo = [m for m in lines if "time/train/step_s" in m]
  assert [m["step"] for m in grpo] == [1, 2]
  for key in REQUIRED + ["mismatch/is_weight_mean", "mismatch/masked_or_truncated_fraction"]:
    assert key in grpo[-1] and np.isfinite(grpo[-1][key]), key
  assert 0 < grpo[-1]["mismatch/is_weight_mean"] <= 2.0  # min(rho, is_cap=2)
  assert grpo[-1]["train/nonfinite_steps"] == 0 and metrics["eval_full/examples"] == 4
  assert any("sft/loss" in m for m in lines) and any(
    "eval_full/accuracy" in m and m["step"] == 0 for m in lines
  )
  # the console's last words: eval_full before and after GRPO side by side
  before = next(m for m in lines if m["step"] == 0 and "eval_full/accuracy" in m)
  out = capsys.readouterr().out
  row = re.search(r"accuracy\s+([\d.]+)\s+([\d.]+)", out)
  assert "before GRPO" in out and "after GRPO" in out and row, out
  assert float(row[1]) == pytest.approx(before["eval_full/accuracy"], abs=5e-4)
  assert float(row[2]) == pytest.approx(metrics["eval_full/accuracy"], abs=5e-4)
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  events = EventAccumulator(str(run_dir / "tb"))
  events.Reload()
  assert set(REQUIRED) <= set(events.Tags()["scalars"])
  assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
  assert (run_dir / "config.yaml").exists() and os.listdir(run_dir / "checkpoints")


def test_resume_continues_exactly(tmp_path, capsys):
  """4 steps straight == a run killed while writing its step-3 checkpoint (checkpoints 2 and a
  truncated 3, metrics of steps 1-3), then --resume to 4: the resume skips the unreadable checkpoint,
  loses one step, writes each step's metrics once, and matches bit for bit (metrics, final weights)."""
  steps = ["eval.full_at_end=false", "run.checkpoint_every=2"]
  _run(tmp_path, "straight", "train.steps=4", *steps)
  _run(tmp_path, "split", "train.steps=3", *steps)
  arrays = [
    p for p in (tmp_path / "split" / "checkpoints" / "3").rglob("*") if p.parent.name == "d"
  ]
  largest = max(arrays, key=lambda p: p.stat().st_size)
  largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
  capsys.readouterr()
  train.main(TINY + [f"run.out_dir={tmp_path / 'split'}", "train.steps=4", "--resume", *steps])
  log = capsys.readouterr().err
  assert "skipped checkpoint 3" in log and "resumed from step 2" in log, log
  a, b = read_metrics(str(tmp_path / "straight")), read_metrics(str(tmp_path / "split"))
  assert [m["step"] for m in b] == [1, 2, 3, 4]
  for x, y in zip(a, b):
    for key in ("reward/total/mean", "train/loss", "train/grad_norm", "completion/length_mean"):
      assert x[key] == y[key], (x["step"], key)
  wa, wb = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "split")
  assert wa.keys() == wb.keys()
  for k in wa:
    np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path, capsys):
  """An SFT warm-up at learning rate 1e30 leaves huge (finite) weights: every GRPO loss is then NaN.
  Each step is skipped and counted; the second in a row stops the run (the command: its message and
  status 1); only finite weights (those the skipped steps kept) are checkpointed."""
  status = train.cli(
    TINY
    + [
      f"run.out_dir={tmp_path / 'nan'}",
      "train.steps=4",
      "train.warmup_sft_steps=1",
      "train.sft_learning_rate=1e30",
      "train.max_nonfinite_steps=2",
      "run.checkpoint_every=1",
      "eval.full_at_end=false",
    ]
  )
  assert status == 1
  assert re.search(r"step 2: 2 steps in a row.*max_nonfinite_steps=2", capsys.readouterr().err)
  rows = [m for m in read_metrics(str(tmp_path / "nan")) if "train/nonfinite_steps" in m]
  assert [(m["step"], m["train/nonfinite_steps"]) for m in rows] == [(1, 1.0), (2, 2.0)]
  assert all(m["train/nonfinite"] == 1.0 and not np.isfinite(m["train/loss"]) for m in rows)
  weights = _final_weights(tmp_path / "nan")  # step 1's checkpoint: skipped, so the SFT weights
  assert all(np.isfinite(w).all() for w in weights.values())
  assert max(np.abs(w).max() for w in weights.values()) > 1e20  # the poison was really there


def _final_weights(run_dir):
  import orbax.checkpoint as ocp

  with ocp.CheckpointManager(os.path.abspath(run_dir / "checkpoints")) as mgr:
    state = mgr.restore(
      mgr.latest_step(), args=ocp.args.Composite(state=ocp.args.StandardRestore())
    )["state"]
  flat = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(state["params"]):
    flat[jax.tree_util.keystr(path)] = np.asarray(leaf)
  return flat


@pytest.mark.parametrize(
  "overrides,match",
  [
    (["train.prompts_per_step=3", "train.micro_batch_size=4"], "do not split"),
    (["mesh.dp=16", "train.prompts_per_step=16", "train.micro_batch_size=1"], "devices"),
    (["train.policy_loss_impl=chunked"], "fused_lm_head"),
    (["data.dataset=gsm8k", "data.path=/nonexistent"], "data.path=/nonexistent.*not found"),
    (["model.checkpoint=/nonexistent"], "model.checkpoint=/nonexistent"),
    (["data.template=chat"], "template"),
    (["sampling.top_p=2", "train.warmup_sft_steps=2"], r"sampling\.top_p must be in \(0, 1\]"),
    (["rollout.attn_impl=bogus", "train.warmup_sft_steps=2"], r"rollout: EngineConfig\.attn_impl"),
    (["train.learning_rate=nan"], "train.learning_rate"),
    (
      ["rollout.max_seq_len=64", "sampling.max_new_tokens=8"],
      r"rollout\.max_seq_len=64 is too short",
    ),
  ],
)
def test_bad_config_fails_before_compiling(tmp_path, overrides, match):
  """Errors name the key, and come before XLA compiles anything (so before an SFT warm-up)."""
  with compile_events() as compiles, pytest.raises(ConfigError, match=match):
    _run(tmp_path, "bad", *overrides)
  assert not compiles, compiles


def test_eight_devices_match_one(tmp_path):
  """(dp, fsdp, tp) = (2, 2, 2) over 8 simulated devices: the same rollouts and losses as 1 device."""
  one = _run(tmp_path, "one", "train.steps=1", "eval.full_at_end=false", "train.micro_batch_size=1")
  eight = _run(
    tmp_path,
    "eight",
    "train.steps=1",
    "eval.full_at_end=false",
    "train.micro_batch_size=1",
    "mesh.dp=2",
    "mesh.fsdp=2",
    "mesh.tp=2",
    "train.fused_lm_head=true",
  )
  assert one["reward/total/mean"] == eight["reward/total/mean"]
  assert one["completion/length_mean"] == eight["completion/length_mean"]
  np.testing.assert_allclose(eight["train/loss"], one["train/loss"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(eight["train/grad_norm"], one["train/grad_norm"], rtol=1e-4)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
  """Two local processes (gloo collectives, one CPU device each) == one process with two devices:
  each process rolls out its share of the prompts, the batch and the metrics are gathered."""
  common = TINY + [
    "train.steps=2",
    "mesh.fsdp=2",
    "train.micro_batch_size=1",
    "run.host_devices=1",
    "eval.full_at_end=true",
  ]
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=one_device_xla_flags())
  port = _free_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "rl.train",
        *common,
        f"run.out_dir={tmp_path / 'multi'}",
        "dist.initialize=true",
        f"dist.coordinator_address=localhost:{port}",
        "dist.num_processes=2",
        f"dist.process_id={i}",
      ],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  single = subprocess.run(
    [
      sys.executable,
      "-m",
      "rl.train",
      *common[:-2],
      "run.host_devices=2",
      f"run.out_dir={tmp_path / 'single'}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
  )
  outs = [p.communicate(timeout=600)[0] for p in procs]
  assert single.returncode == 0, single.stderr[-3000:]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  a, b = read_metrics(str(tmp_path / "single")), read_metrics(str(tmp_path / "multi"))
  # one line per step (only process 0 writes), after step 0's baseline eval_full
  assert [m["step"] for m in b] == [0, 1, 2] and "eval_full/accuracy" in b[0]
  assert a[0]["eval_full/accuracy"] == b[0]["eval_full/accuracy"]
  a, b = a[1:], b[1:]
  for x, y in zip(a, b):
    for key in ("reward/total/mean", "completion/length_mean", "rollout/generated_tokens"):
      assert x[key] == y[key], key
    np.testing.assert_allclose(y["train/loss"], x["train/loss"], rtol=1e-5, atol=1e-6)
  assert (
    a[-1]["eval_full/accuracy"] == b[-1]["eval_full/accuracy"] and b[-1]["eval_full/examples"] == 4
  )


def _spread_gsm8k(directory, sizes) -> str:
  """A GSM8K-format split (train.jsonl / test.jsonl) whose questions span `sizes` repeats: prompts
  from ~50 to ~500 byte tokens, as GSM8K's spread (104 to 1134) does at a smaller scale."""
  directory.mkdir()
  question = lambda n: ("How many apples " + "and pears " * n).strip() + "?"
  rows = [{"question": question(n), "answer": f"{n} + 1 = {n + 1}\n#### {n + 1}"} for n in sizes]
  (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (directory / "test.jsonl").write_text(json.dumps(rows[0]) + "\n")
  return str(directory)


def test_widths_are_fixed_up_front_so_later_steps_do_not_recompile(tmp_path):
  """Eight GRPO steps (reference and old log-probs on) on prompts of 55 to 495 tokens: after the
  first step the update, the log-prob passes and the metrics never compile again; the rollout's
  prefill compiles only in a step whose prompt width brings a new power-of-two bucket (the engine's
  declared set, rl.rollout.engine.bucket) — not again in step 2 (the KV cache is created with the
  sharding the jitted steps give it, so its layout does not change after the first decode); the
  decode chunk compiles only
  shapes of its declared set (power-of-two rows and page-table widths). Catches a per-step width (the
  PROMPT_BUCKET rounding that recompiled the 0.5B update every few steps on an H100) and any other
  per-step shape. The SFT warm-up compiles its step once too. Also: compiling steps are left out of
  step_avg and report compiles / compile_s."""
  data = _spread_gsm8k(tmp_path / "gsm8k", range(0, 43, 3))
  cfg = cli.parse_args(
    TINY
    + [
      "data.dataset=gsm8k",
      f"data.path={data}",
      "rollout.max_seq_len=512",
      "train.micro_batch_size=4",
      "train.beta=0.05",
      "train.ppo_epochs=2",
      "run.tensorboard=false",
      f"run.out_dir={tmp_path / 'run'}",
    ]
  )
  run = train.make_run(cfg)
  s = run.setup
  longest = max(len(s.encode(e.question)) for e in s.train_data)
  assert s.prompt_width == round_up(longest, WIDTH_ALIGN) == 512
  seen, rows, widths = set(), [], []
  # the decode chunk's declared shapes: rows and page-table width are powers of two chosen by the
  # engine (rl.rollout.paged.decode_rows / decode_width), so a run compiles it at most that many times
  ecfg = cfg.rollout
  decode_rows_set = {paged.decode_rows(n, ecfg.max_slots) for n in range(1, ecfg.max_slots + 1)}
  decode_widths = {
    paged.decode_width(p, ecfg.pages_per_seq) for p in range(1, ecfg.pages_per_seq + 1)
  }
  decode_compiles = 0
  try:
    with compiled_functions() as names:  # the SFT warm-up's batches span the prompt lengths too
      run.sft(4, progress=False)
    assert names.count("jit(train_step)") == 1, names
    for step in range(8):
      with compiled_functions() as names:
        rows.append(run.step(step))
      width = bucket(max(len(s.encode(e.question)) for e in step_examples(s, step)))
      widths.append(width)
      assert rows[-1]["time/train/compiles"] == len(names), (step, names)
      decode_compiles += names.count("jit(decode_chunk)")
      names = [n for n in names if n != "jit(decode_chunk)"]
      if step == 0:
        assert {"jit(train_step)", "jit(batch_token_logps)"} <= set(names)
      elif width not in seen:  # a new prefill bucket: prefill and its position / staging ops
        assert set(names) <= {"jit(prefill)", "jit(iota)", "jit(broadcast_in_dim)", "jit(stage)"}
      else:
        assert names == [], (step, names)
      seen.add(width)
    assert 1 <= decode_compiles <= len(decode_rows_set) * len(decode_widths), decode_compiles
  finally:
    run.close()
  assert len(set(widths)) > 1  # the data did bring several prefill buckets
  steady = [r for r in rows if r["time/train/compiles"] == 0]
  assert len(steady) >= 3 and rows[0]["time/train/compile_s"] > 0
  assert "time/train/step_avg_last10_s" not in rows[0]  # nothing steady to average yet
  last10 = [r["time/train/step_s"] for r in steady][-10:]
  assert rows[-1]["time/train/step_avg_last10_s"] == pytest.approx(np.mean(last10))
