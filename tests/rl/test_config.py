import pytest

from rl import configlib
from rl.config import GRPOConfig


def test_defaults_round_trip_through_yaml(tmp_path):
  cfg = GRPOConfig()
  configlib.dump(cfg, tmp_path / "c.yaml")
  assert configlib.load(GRPOConfig, tmp_path / "c.yaml") == cfg
  assert cfg.grad_accum_steps == 8 * 8 // 16


def test_yaml_then_overrides(tmp_path):
  (tmp_path / "c.yaml").write_text("train:\n  learning_rate: 3.0e-6\n  steps: 5\nrollout:\n  backend: dense\n")
  cfg = configlib.load(GRPOConfig, tmp_path / "c.yaml", ["train.steps=7", "sampling.top_p=0.9",
                                                          "model.checkpoint=/ckpt", "rollout.num_pages=null"])
  assert cfg.train.learning_rate == 3e-6 and cfg.train.steps == 7 and cfg.rollout.backend == "dense"
  assert cfg.sampling.top_p == 0.9 and cfg.model.checkpoint == "/ckpt" and cfg.rollout.num_pages is None


@pytest.mark.parametrize("overrides,match", [
    (["train.stepz=3"], r"unknown config key.*train.stepz"),
    (["train.steps=three"], "train.steps must be an integer"),
    (["train.fused_lm_head=1"], "true or false"),
    (["train.policy_loss_impl=cuda"], "must be one of"),
    (["rollout.backend=vllm"], "backend"),
    (["sampling.group_size=1"], "group_size"),
    (["train.micro_batch_size=5"], "do not split into micro-batches"),
    (["mesh.dp=3"], "do not split"),
    (["sampling.group_size=128"], "max_slots"),
    (["train.steps"], "key.sub=value"),
])
def test_bad_values_are_clear_errors(overrides, match):
  with pytest.raises(ValueError, match=match):
    configlib.load(GRPOConfig, None, overrides)
