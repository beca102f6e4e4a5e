"""bench.loop.compile_time at a tiny preset: the programs it times are the loop's, and it reports them."""

import json

from bench.loop import compile_time


def test_reports_every_program_at_the_configs_shapes(tmp_path):
  """Catches the bench drifting from the loop: a train step or decode chunk whose signature changed
  (rl.update / rl.rollout.steps) fails to trace here instead of silently timing something else."""
  out = tmp_path / "ct.json"
  report = compile_time.main(
    [
      "--config",
      "configs/cpu-default.yaml",
      "--prompt-width",
      "24",
      "--out",
      str(out),
      "model.preset=tiny",
      "train.prompts_per_step=2",
      "train.micro_batch_size=8",
    ]
  )
  assert json.loads(out.read_text()) == report
  assert report["batch_km"] == [2, 8] and report["prompt_width"] == 24
  for name in ("train_step", "decode_chunk"):
    r = report["programs"][name]
    assert r["compile_s"] > 0 and r["cpu_s"] > 0
    assert abs(r["trace_s"] + r["lower_s"] + r["compile_s"] - r["total_s"]) < 1e-6
