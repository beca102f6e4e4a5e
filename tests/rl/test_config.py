import os
import subprocess
import sys

import pytest

from rl import configlib, train
from rl.config import GRPOConfig
from rl.configlib import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_round_trip_through_yaml(tmp_path):
  cfg = GRPOConfig()
  configlib.dump(cfg, tmp_path / "c.yaml")
  assert configlib.load(GRPOConfig, tmp_path / "c.yaml") == cfg
  assert cfg.resolved(1).grad_accum_steps == 8 * 8 // 16
  assert cfg.resolved(4).mesh.fsdp == 4 and cfg.resolved(4).grad_accum_steps == 1
  assert cfg.resolved(1).sft_sequences == 64 and cfg.resolved(1).sft_accum_steps == 4


def test_sft_batch_size_splits_into_micro_batches():
  load = lambda *o: configlib.load(GRPOConfig, None, ["mesh.fsdp=1", *o])
  small = load("train.sft_batch_size=12")  # under one micro-batch: one step of 12
  assert small.sft_sequences == 12 and small.sft_accum_steps == 1
  assert load("train.sft_batch_size=48").sft_accum_steps == 3
  with pytest.raises(ConfigError, match=r"train.sft_batch_size=40 .* multiple of the micro-batch"):
    load("train.sft_batch_size=40")
  with pytest.raises(ConfigError, match=r"train.sft_batch_size"):
    load("train.sft_batch_size=-1")


def test_yaml_then_overrides(tmp_path):
  (tmp_path / "c.yaml").write_text(
    "train:\n  learning_rate: 3.0e-6\n  steps: 5\nrollout:\n  backend: dense\n"
  )
  cfg = configlib.load(
    GRPOConfig,
    tmp_path / "c.yaml",
    ["train.steps=7", "sampling.top_p=0.9", "model.checkpoint=/ckpt", "rollout.num_pages=null"],
  )
  assert cfg.train.learning_rate == 3e-6 and cfg.train.steps == 7 and cfg.rollout.backend == "dense"
  assert (
    cfg.sampling.top_p == 0.9 and cfg.model.checkpoint == "/ckpt" and cfg.rollout.num_pages is None
  )


@pytest.mark.parametrize(
  "overrides,match",
  [
    (["train.stepz=3"], r"unknown config key.*train.stepz"),
    (["train.steps=three"], "train.steps must be an integer"),
    (["train.fused_lm_head=1"], "true or false"),
    (["train.policy_loss_impl=cuda"], "must be one of"),
    (["rollout.backend=vllm"], "backend"),
    (["sampling.group_size=1"], "group_size"),
    (["train.micro_batch_size=5", "mesh.fsdp=1"], "do not split into micro-batches"),
    (["mesh.dp=3", "mesh.fsdp=1"], "do not split"),
    (["mesh.dp=-1"], "at most one -1"),
    (["train.policy_loss_impl=chunked"], "fused_lm_head"),
    (["sampling.max_new_tokens=256"], "no room for a prompt"),
    (["reward.correct=0", "reward.format=0"], "nothing to learn"),
    (["eval.batch=0"], "eval.batch"),
    (["sampling.group_size=128"], "max_slots"),
    (["train.steps"], "key.sub=value"),
    # Each range check names the key, the allowed range and the value.
    (["sampling.top_p=2"], r"sampling\.top_p must be in \(0, 1\], got 2"),
    (["sampling.top_p=0"], r"sampling\.top_p must be in \(0, 1\], got 0"),
    (["sampling.top_k=-3"], r"sampling\.top_k must be >= 0, got -3"),
    (["sampling.max_new_tokens=0"], r"sampling\.max_new_tokens must be >= 1, got 0"),
    (["sampling.temperature=nan"], r"sampling\.temperature must be finite and > 0, got nan"),
    (["sampling.temperature=0"], r"sampling\.temperature must be finite and > 0"),
    (
      ["rollout.attn_impl=bogus"],
      r"rollout: EngineConfig\.attn_impl must be one of \('auto', 'pallas', 'xla', 'mosaic_gpu'\)",
    ),
    (["train.learning_rate=nan"], r"train\.learning_rate must be finite and > 0, got nan"),
    (["train.learning_rate=.inf"], r"train\.learning_rate must be finite and > 0, got inf"),
    (["train.learning_rate=0"], r"train\.learning_rate must be finite and > 0, got 0"),
    (["train.sft_learning_rate=-1e-3"], r"train\.sft_learning_rate must be finite and > 0"),
    (["train.beta=-0.1"], r"train\.beta must be finite and >= 0"),
    (["train.epsilon_low=1.5"], r"train\.epsilon_low must be in \[0, 1\), got 1\.5"),
    (["train.epsilon_high=nan"], r"train\.epsilon_high must be finite and >= 0"),
    (["train.weight_decay=-0.01"], r"train\.weight_decay must be finite and >= 0"),
    (["train.max_grad_norm=inf"], r"train\.max_grad_norm must be finite and >= 0"),
    (["train.seed=-1"], r"train\.seed must be in \[0, 2147483648\), got -1"),
    (["train.max_nonfinite_steps=0"], r"train\.max_nonfinite_steps must be >= 1, got 0"),
    (["train.warmup_sft_steps=-2"], r"train\.warmup_sft_steps must be >= 0"),
    (["train.lr_warmup_steps=-1"], r"train\.lr_warmup_steps must be >= 0"),
    (["train.lr_schedule=linear"], r"train\.lr_schedule"),
    (["reward.correct=nan"], r"reward\.correct must be finite and >= 0, got nan"),
    (["reward.format=-1"], r"reward\.format must be finite and >= 0"),
    (["eval.every=-1"], r"eval\.every must be >= 0"),
    (["run.log_every=0"], r"run\.log_every must be >= 1"),
    (["run.host_devices=0"], r"run\.host_devices must be >= 1 \(or null\), got 0"),
    (["dist.num_processes=2", "dist.process_id=2"], r"dist\.process_id must be in \[0, 2\)"),
    (["dist.cpu_collectives=nccl"], r"dist\.cpu_collectives must be one of"),
    (["data.template=chat"], r"data\.template must be one of \['compact', 'gsm8k'\]"),
    (
      ["data.synthetic_levels=[4]"],
      r"data\.synthetic_levels must be .* levels from \[0, 1, 2, 3\]",
    ),
    (["data.synthetic_train=0"], r"data\.synthetic_train must be >= 1"),
    (["model.dtype=f32"], r"model\.dtype must be one of"),
    # the mismatch-aware loss (issue 18)
    (["train.is_mode=tis"], r"train\.is_mode.* must be one of \['token_truncate', 'token_mask'"),
    (["train.importance_sampling_level=seq"], r"train\.importance_sampling_level must be one of"),
    (["train.is_cap=0"], r"train\.is_cap must be finite and > 0, got 0"),
    (["train.is_cap=nan"], r"train\.is_cap must be finite and > 0, got nan"),
    (["train.epsilon_c=1"], r"train\.epsilon_c must be finite and > 1 \(or null\), got 1"),
    (["train.max_log_ratio=-5"], r"train\.max_log_ratio must be finite and > 0 \(or null\)"),
  ],
)
def test_bad_values_are_clear_errors(overrides, match):
  with pytest.raises(ConfigError, match=match):
    configlib.load(GRPOConfig, None, overrides)


def test_the_loss_spec_carries_every_loss_key():
  cfg = configlib.load(
    GRPOConfig,
    None,
    [
      "train.loss_type=bnpo",
      "train.beta=0.1",
      "train.epsilon_high=0.28",
      "sampling.temperature=0.7",
      "sampling.max_new_tokens=32",
      "train.is_mode=sequence_mask",
      "train.is_cap=3",
      "train.importance_sampling_level=sequence",
      "train.epsilon_c=3.0",
      "train.max_log_ratio=null",
    ],
  )
  spec = cfg.loss_spec
  assert (spec.loss_type, spec.beta, spec.epsilon_low, spec.epsilon_high) == (
    "bnpo",
    0.1,
    0.2,
    0.28,
  )
  assert (spec.temperature, spec.max_completion_length) == (0.7, 32)
  assert (spec.is_mode, spec.is_cap, spec.importance_sampling_level) == (
    "sequence_mask",
    3.0,
    "sequence",
  )
  assert spec.epsilon_c == 3.0 and spec.max_log_ratio is None
  default = GRPOConfig().loss_spec
  assert default.is_mode is None and default.max_log_ratio == 20.0 and default.epsilon_c is None


def test_missing_or_broken_config_file_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match="cannot read the config file"):
    configlib.load(GRPOConfig, tmp_path / "nowhere.yaml")
  (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
  with pytest.raises(ConfigError, match="not valid YAML"):
    configlib.load(GRPOConfig, tmp_path / "bad.yaml")


def test_cli_prints_the_config_error_alone_and_exits_2(capsys):
  assert train.cli(["sampling.top_p=2", "run.progress=false"]) == 2
  err = capsys.readouterr().err
  assert err.strip().splitlines() == [
    "python -m rl.train: config error: sampling.top_p must be in (0, 1], got 2.0"
  ]


def test_cli_exit_status_from_the_shell():
  """`python -m rl.train` itself: status 2, one line on stderr, no traceback."""
  proc = subprocess.run(
    [sys.executable, "-m", "rl.train", "train.learning_rate=nan"],
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert (
    "Traceback" not in proc.stderr and "train.learning_rate must be finite and > 0" in proc.stderr
  )
