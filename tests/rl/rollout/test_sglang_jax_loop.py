"""A short GRPO run with rollout.backend=sglang_jax (where sglang-jax is installed: `nox -s sglang`)."""

import numpy as np
import pytest

pytest.importorskip("sgl_jax")

from rl import train
from rl.logging.metrics import read_metrics
from tests.rl.test_train import TINY


def test_short_grpo_run_with_sglang_backend(tmp_path):
  train.main(
    TINY
    + [
      "model.preset=tiny-h128",
      "rollout.backend=sglang_jax",
      "train.steps=2",
      "data.synthetic_test=2",
      f"run.out_dir={tmp_path}",
    ]
  )
  rows = read_metrics(str(tmp_path))
  steps = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["train/loss"]) for r in steps)
  assert all(r["rollout/tokens_per_s"] > 0 for r in steps)
  assert any("eval_full/accuracy" in r for r in rows)
