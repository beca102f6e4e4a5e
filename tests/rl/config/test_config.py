import dataclasses
import os
import subprocess
import sys

import pytest

from bench.device import plan as device_plan
from rl import cli, configlib, train
from rl.aot import check
from rl.config import GRPOConfig
from rl.config import platform as platforms
from rl.configlib import ConfigError
from tests.compiles import compile_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


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
    # issue 40: rematerialisation and the TPU slice a config names
    (["train.remat=some"], r"train\.remat must be one of \['none', 'layer', 'full'\], got 'some'"),
    (["mesh.topology=v6e-6"], r"mesh\.topology='v6e-6': .*not a power of two"),
    (["mesh.topology=v9-8"], r"mesh\.topology='v9-8': unknown TPU generation"),
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
    # batch-invariant numerics (issue 48) need the decoder's own decode and attention
    (
      ["model.batch_invariant=true", "rollout.backend=sglang_jax"],
      r"model\.batch_invariant .*rollout\.backend must be paged or dense",
    ),
    (
      ["model.batch_invariant=true", "rollout.attn_impl=pallas"],
      r"model\.batch_invariant .*rollout\.attn_impl must be 'xla'",
    ),
  ],
)
def test_bad_values_are_clear_errors(overrides, match):
  with pytest.raises(ConfigError, match=match):
    configlib.load(GRPOConfig, None, overrides)


def test_check_modules_do_not_import_the_entry_points():
  """rl.agent -> rl.cli -> rl.aot.check used to import rl.agent back (an import circle): the check and the
  programs it builds import the update modules, never an entry point."""
  import subprocess
  import sys

  code = "import sys, rl.aot.check, rl.aot.slice_check; assert 'rl.agent.__main__' not in sys.modules, 'rl.agent'"
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


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


# ------------------------------------------------------------------------------------------ --check
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml"))
# bench.device's parity step: the 0.5B config's xla and pallas loss arms at its own overrides (read
# from its plan, so a change there is checked here)
DEVICE_PARITY = device_plan.loop_overrides("large", None)
VARIANTS = [
  (name, [])
  for name in CONFIGS  # as shipped
] + [
  ("gpu-qwen2.5-0.5b.yaml", [*DEVICE_PARITY, f"train.policy_loss_impl={impl}"])
  for impl in ("xla", "pallas")
]


def _checked_args(name: str, overrides=()):
  """The --check command line of configs/`name`: rl.agent's when it sets env:, and the GSM8K the
  config names, else the checkout's default copy (configs say ../shared/data/gsm8k: a worktree
  elsewhere has none there); a skip when there is no GSM8K at all."""
  from rl.data.gsm8k import default_dir

  path = os.path.join(ROOT, "configs", name)
  raw = configlib.read(path, overrides)
  entry = "rl.agent" if "env" in raw else "rl.train"
  extra = []
  data = raw.get("data", {})
  if data.get("dataset") == "gsm8k" and not os.path.isdir(os.path.join(ROOT, data.get("path", ""))):
    try:
      extra = [f"data.path={default_dir()}"]
    except FileNotFoundError as e:
      pytest.skip(str(e))
  args = cli.arg_parser().parse_intermixed_args([path, "--check", *overrides, *extra][1:])
  args.config = path
  return args, entry


@pytest.mark.parametrize("name,overrides", VARIANTS, ids=lambda v: str(v)[:40])
def test_every_config_checks_for_its_platform(name, overrides, monkeypatch):
  """Every shipped config (and bench.device's parity arms) passes --check for its platform: impl x
  platform, mesh, prompt room on its dataset, memory at its real shapes; then the train step and
  the decode chunk lower for the platform (GPU: CUDA, from this CPU host) with the config's settings
  with one layer of the config's model (all layers: the slow test below). Catches a shipped config that
  stops at load (gpu-*: max_seq_len 1024 < GSM8K's 1134-token prompt) or in the first compile
  (fused pallas on GPU)."""
  monkeypatch.chdir(ROOT)  # configs name data paths relative to the checkout
  args, entry = _checked_args(name, overrides)
  cfg = cli.config_of(args, entry)
  target = cli.target_platform(args)
  assert target == name.split("-")[0]
  report = check.check(cfg, target, entry, lower=False)
  assert report["memory_gib"]["total"] > 0
  # the config's model with one layer: every width and kernel of the real one, 1/24 of the tracing
  small = dataclasses.replace(check._model_config(cfg), num_layers=1)
  small_cfg = dataclasses.replace(cfg, mesh=cfg.mesh.resolve(report["devices"]))
  lowered = check.lower_steps(
    small_cfg, small, target, report["prompt_width"], report["loss_impl"], entry
  )
  assert set(lowered) == {"train_step", "decode_chunk"}


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides", VARIANTS, ids=lambda v: str(v)[:40])
def test_every_config_lowers_at_its_real_shapes(name, overrides, monkeypatch):
  """The whole --check, the real model included (the 0.5B GPU train step: ~32 s to lower on CPU)."""
  monkeypatch.chdir(ROOT)
  args, entry = _checked_args(name, overrides)
  assert cli.run_check(args, entry)["lowered_s"]["train_step"] > 0


def test_check_command_line(capsys, monkeypatch):
  """`python -m rl.train --config X --check`: status 0 and the figures; a config its platform cannot
  run: status 2 and one line (the impl table, at load: nothing compiles)."""
  monkeypatch.chdir(ROOT)
  assert train.cli(["--config", "configs/cpu-default.yaml", "--check", "model.preset=tiny"]) == 0
  assert "ok for cpu" in capsys.readouterr().out
  with compile_events() as compiles:
    status = train.cli(["--config", "configs/cpu-default.yaml", "--check", "--platform", "tpu",
                        "train.policy_loss_impl=mosaic_gpu"])  # fmt: skip
  assert status == 2 and not compiles
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "not available on tpu" in err[0] and "'pallas'" in err[0], err


@pytest.mark.parametrize(
  "platform,fused,impl,expected",
  [
    # this project's fused LM-head kernel on GPU: fused_linear's "pallas" is the Mosaic GPU kernel
    # there (bf16 / f16; chunked for f32) — mapping it to chunked would hide the kernel from the loop
    ("gpu", True, "pallas", "pallas"),
    ("gpu", True, "mosaic_gpu", "mosaic_gpu"),
    ("gpu", False, "pallas", "pallas"),  # Triton
    ("tpu", True, "pallas", "pallas"),  # the tiled fully fused kernels
    ("cpu", False, "xla", "xla"),
    ("gpu", False, "mosaic_gpu", "mosaic_gpu"),
  ],
)
def test_pallas_means_this_projects_kernel_on_the_platform(platform, fused, impl, expected):
  assert platforms.loss_impl(platform, fused, impl) == expected


@pytest.mark.parametrize(
  "platform,fused,impl",
  [("tpu", False, "mosaic_gpu"), ("tpu", True, "mosaic_gpu")],
)
def test_an_impl_the_platform_lacks_names_the_alternatives(platform, fused, impl):
  with pytest.raises(ConfigError, match=rf"policy_loss_impl={impl} is not available on {platform}"):
    platforms.loss_impl(platform, fused, impl)


@pytest.mark.parametrize(
  "overrides,match",
  [
    (["mesh.tp=3", "mesh.fsdp=1"], r"mesh\.tp=3 does not divide"),
    (["rollout.max_seq_len=1024"], r"rollout\.max_seq_len=1024 is too short.*>= 1648"),
    (  # unfused f32 logits (and their gradient) of 128 x 512 x 151936: over an H100's 80 GiB
      ["train.fused_lm_head=false", "train.prompts_per_step=16", "train.micro_batch_size=128"],
      r"estimate of one gpu device's memory, .* exceeds its 80 GiB",
    ),
  ],
)
def test_check_refuses_what_the_platform_cannot_run(overrides, match, monkeypatch):
  """Each a ConfigError before anything lowers (lower=True: the check stops first)."""
  monkeypatch.chdir(ROOT)
  args, entry = _checked_args("gpu-qwen2.5-0.5b.yaml", overrides)
  with compile_events() as compiles, pytest.raises(ConfigError, match=match):
    check.check(cli.config_of(args, entry), "gpu", entry)
  assert not [e for e in compiles if "backend_compile" in e]  # (eval_shape traces)


# ------------------------------------------------------------------------------------ ignored keys
def test_a_section_the_entry_point_ignores_is_an_error_naming_the_right_one(capsys):
  """issue 31: `rl.train --config configs/cpu-multiturn.yaml` ran single-turn GRPO, env: ignored."""
  assert train.cli(["--config", os.path.join(ROOT, "configs/cpu-multiturn.yaml")]) == 2
  err = capsys.readouterr().err
  assert "env.name" in err and "use python -m rl.agent" in err, err
  with pytest.raises(ConfigError, match=r"train\.vf_coef: not read by python -m rl\.train"):
    cli.parse_args(["train.vf_coef=0.5"], entry="rl.train")
  with pytest.raises(ConfigError, match=r"train\.is_mode: .*use python -m rl\.train"):
    cli.parse_args(["train.is_mode=token_mask"], entry="rl.agent")
  assert cli.parse_args(["env.name=grid"], entry="rl.agent").env.name == "grid"
  assert cli.parse_args(["train.is_mode=token_mask"], entry="rl.train").train.is_mode
