import pytest

from rl import configlib
from rl.config import GRPOConfig


def test_defaults_round_trip_through_yaml(tmp_path):
  cfg = GRPOConfig()
  configlib.dump(cfg, tmp_path / "c.yaml")
  assert configlib.load(GRPOConfig, tmp_path / "c.yaml") == cfg
  assert cfg.resolved(1).grad_accum_steps == 8 * 8 // 16
  assert cfg.resolved(4).mesh.fsdp == 4 and cfg.resolved(4).grad_accum_steps == 1


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
    (["data.dataset=gsm8k"], "data.path"),
    (["eval.batch=0"], "eval.batch"),
    (["sampling.group_size=128"], "max_slots"),
    (["train.steps"], "key.sub=value"),
  ],
)
def test_bad_values_are_clear_errors(overrides, match):
  with pytest.raises(ValueError, match=match):
    configlib.load(GRPOConfig, None, overrides)
