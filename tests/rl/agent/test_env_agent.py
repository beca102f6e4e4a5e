"""rl.agent end to end on the tiny model: PPO (and GRPO) raise the reward of a trivial two-turn
environment, the update is the same whatever the gradient-accumulation split, the metrics are
written, and configurations it cannot run are refused before anything compiles."""

import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from rl import cli
from rl.agent import __main__ as agent
from rl.agent.step import GRID_SYSTEM, GRID_WARMUP_SEEDS
from rl.configlib import ConfigError
from rl.env.base import StepResult
from rl.logging.metrics import read_metrics
from rl.optimizer import init_optimizer_state
from tests.compiles import compiled_functions, one_device_xla_flags
from tests.rl.test_train import _free_port


class AsciiEnv:
  """Two turns; each turn's reward is the fraction of the reply's characters that are ASCII (about
  0.4 for the untrained byte model): a dense signal a tiny model can follow in a few steps."""

  max_turns = 2

  def reset(self, seed):
    self.turn = 0
    return f"say something {seed % 3}"

  def step(self, action):
    self.turn += 1
    r = sum(c < "\x80" for c in action) / max(len(action), 1)
    done = self.turn >= self.max_turns
    return StepResult("again", r, done, {"success": r > 0.5} if done else {})


def _cfg(tmp_path, *overrides):
  return cli.parse_args(
    [
      "model.preset=tiny",
      "rollout.max_seq_len=128",
      "rollout.max_slots=16",
      "rollout.page_size=8",
      "sampling.group_size=4",
      "sampling.max_new_tokens=6",
      "train.prompts_per_step=4",
      "train.micro_batch_size=8",
      "train.learning_rate=3e-3",
      "train.ppo_epochs=2",
      "train.loss_type=dapo",
      "data.synthetic_train=20",
      "data.synthetic_test=4",
      "eval.full_at_end=false",
      "run.progress=false",
      "run.tensorboard=false",
      "mesh.fsdp=1",
      f"run.out_dir={tmp_path}",
      *overrides,
    ]
  )


def test_ppo_learns_a_trivial_environment(tmp_path):
  """15 PPO steps (about a minute on 2 CPU cores): the mean episode reward (max 2) rises clearly.
  Measured: first four steps ~0.80, last four ~1.20. A flipped advantage sign, a loss mask that
  misses the model tokens or a broken GAE leaves it flat or lowers it."""
  steps = 15
  trainer = agent.make_run(
    _cfg(tmp_path, "train.algorithm=ppo", f"train.steps={steps}"), AsciiEnv, "Be brief."
  )
  rewards = [trainer.step(s)["env/reward_mean"] for s in range(steps)]
  assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.2, rewards


def test_update_does_not_depend_on_the_accumulation_split(tmp_path, loss_type="grpo"):
  """Same batch, K = 1 micro-batch of 16 vs K = 4 of 4: the loss and the gradient norm agree (each
  micro-batch's loss is scaled to its share of the global loss; grpo's per-sequence mean is the
  reduction a wrong scale would break)."""
  trainer = agent.make_run(
    _cfg(tmp_path, "train.algorithm=ppo", f"train.loss_type={loss_type}"), AsciiEnv, "Be brief."
  )
  batch = _captured_batch(trainer)
  fn = trainer.program.update_for(batch.model_mask.shape[-1])
  outs = []
  for k in (1, 4):
    state = jax.tree.map(jax.numpy.copy, trainer.program._state())
    # (copies: the update donates its state)
    outs.append(fn(state, jax.tree.map(lambda x, k=k: x.reshape(k, -1, *x.shape[2:]), batch))[1])
  for key in ("loss", "policy_loss", "value_loss", "grad_norm", "clip_fraction", "approx_kl"):
    np.testing.assert_allclose(outs[0][key], outs[1][key], rtol=2e-4, atol=1e-7, err_msg=key)
  assert float(outs[0]["grad_norm"]) > 0 and float(outs[0]["value_loss"]) > 0


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_grid_run_writes_the_metrics(tmp_path, algorithm):
  cfg = _cfg(
    tmp_path,
    "env.name=grid",
    "env.max_turns=2",
    "rollout.max_seq_len=256",
    f"train.algorithm={algorithm}",
    "train.steps=2",
    "eval.full_at_end=true",
    "eval.batch=2",
  )
  trainer = agent.make_run(cfg)
  try:
    last = trainer.run()
  finally:
    trainer.close()
  rows = read_metrics(str(tmp_path))
  # step 0: eval_full before the first update (the baseline the run compares against)
  assert [r["step"] for r in rows] == [0, 1, 2] and "eval_full/accuracy" in rows[0]
  rows = rows[1:]
  critic = ("critic/value_loss", "critic/explained_variance")
  for key in (
    "env/success_rate",
    "env/turns_mean",
    "env/reward_mean",
    "ppo/approx_kl",
    "ppo/clip_fraction",
    "train/grad_norm",
    *(critic if algorithm == "ppo" else ()),
  ):
    assert all(np.isfinite(r[key]) for r in rows), key
  if algorithm == "grpo":  # no critic is trained
    assert not any(key in r for r in rows for key in critic)
  assert 1 <= rows[-1]["env/turns_mean"] <= 2
  assert last["eval_full/examples"] == 2


def _captured_batch(trainer):
  """The batch of the trainer's first step (the step runs; the batch is what its update saw)."""
  captured, program = [], trainer.program
  update = program.update_for

  def spy(completion_len):
    fn = update(completion_len)
    return lambda state, batch: (captured.append(batch), fn(state, batch))[1]

  program.update_for = spy
  trainer.step(0)
  program.update_for = update
  return captured[0]


def _fresh_state(trainer):
  """(params, critic, optimizer states) as copies (the update donates them), with fresh optimizer
  states: the first step's Adam momentum would move every weight by itself."""
  program, params = trainer.program, trainer.policy.params
  opt_state = init_optimizer_state(program.policy_opt, params, trainer.setup.mesh)
  state = (params, program.head_params, opt_state, program.head_opt.init(program.head_params))
  return jax.tree.map(jax.numpy.copy, state)


@pytest.mark.parametrize("critic", ["head", "model"])
def test_the_value_gradient_reaches_the_policy_only_through_a_shared_head(tmp_path, critic):
  """Zero advantages make the policy term's gradient exactly zero, so only the value loss moves
  anything. A value head shares the policy's trunk: the policy's weights move. A separate critic model
  (train.critic=model) takes the value gradient alone: the policy's weights stay bit for bit, its own
  trunk moves. Catches a critic model that still reads (and trains) the policy's hidden states, or
  one whose trunk shares the policy's buffers."""
  cfg = _cfg(
    tmp_path,
    "train.algorithm=ppo",
    f"train.critic={critic}",
    "train.vf_coef=1.0",
    "train.value_clip=null",
  )  # unclipped: the captured old values are a step stale, a clipped loss could have no gradient
  trainer = agent.make_run(cfg, AsciiEnv, "Be brief.")
  batch = _captured_batch(trainer)
  batch = batch._replace(
    advantages=jax.numpy.zeros_like(batch.advantages), returns=batch.returns + 1.0
  )
  state = _fresh_state(trainer)
  before = jax.tree.map(np.asarray, state[:2])
  new, metrics = trainer.program.update_for(batch.model_mask.shape[-1])(state, batch)
  assert float(metrics["value_loss"]) > 0 and float(metrics["grad_norm"]) > 0
  assert float(metrics["nonfinite"]) == 0
  moved = lambda a, b: any(not np.array_equal(x, np.asarray(y)) for x, y in zip(a, b))
  policy_moved = moved(jax.tree.leaves(before[0]), jax.tree.leaves(new[0]))
  assert policy_moved == (critic == "head")
  assert moved(jax.tree.leaves(before[1]), jax.tree.leaves(new[1]))  # the critic learns
  if critic == "model":  # a copy of the policy's initial weights, then trained apart from it
    assert set(new[1]) == {"trunk", "head"}


def test_kl_term_pulls_the_policy_towards_the_reference(tmp_path):
  """train.beta > 0 in rl.agent: the reference is the policy rl.agent starts GRPO / PPO from, so the
  first step's KL is ~0; with the reference moved away (its weights scaled) and zero advantages, the
  update's only policy gradient is the KL's, and one step lowers it. A KL wired with the wrong sign
  raises it; one not wired in leaves the weights where they were."""
  cfg = _cfg(
    tmp_path,
    "train.algorithm=grpo",
    "train.beta=0.5",
    "train.learning_rate=1e-3",
    "train.ppo_epochs=1",
  )
  trainer = agent.make_run(cfg, AsciiEnv, "Be brief.")
  assert trainer.policy.ref_params is not None
  first = trainer.step(0)
  assert 0 <= first["train/kl"] < 1e-5, first["train/kl"]  # before its update: the reference itself
  trainer.policy.ref_params = jax.tree.map(lambda x: x * 1.5, trainer.policy.ref_params)
  batch = _captured_batch(trainer)
  batch = batch._replace(advantages=jax.numpy.zeros_like(batch.advantages))
  state = _fresh_state(trainer)
  update = trainer.program.update_for(batch.model_mask.shape[-1])
  kls = []
  for _ in range(3):
    state, metrics = update(state, batch)
    kls.append(float(metrics["kl"]))
  assert kls[0] > 1e-3 and kls[2] < kls[0], kls


def test_separate_critic_of_another_preset_runs_and_resumes(tmp_path):
  """train.critic_preset: a critic of a different size (cpu-small's H = 128 under the tiny policy);
  the checkpoint holds its trunk, and --resume takes it back."""
  cfg = _cfg(
    tmp_path,
    "train.algorithm=ppo",
    "train.critic=model",
    "train.critic_preset=cpu-small",
    "train.steps=1",
    "run.checkpoint_every=1",
  )
  first = agent.make_run(cfg, AsciiEnv, "Be brief.")
  try:
    last = first.run()
  finally:
    first.close()
  assert np.isfinite(last["critic/value_loss"]) and np.isfinite(last["critic/explained_variance"])
  assert first.program.head_params["trunk"]["embed_tokens"]["embedding"][...].shape[-1] == 128
  cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
  second = agent.make_run(cfg, AsciiEnv, "Be brief.")
  try:
    assert second.resume() == 1
    heads = (first.program.head_params, second.program.head_params)
    jax.tree.map(np.testing.assert_array_equal, *heads)
  finally:
    second.close()


def test_grid_warmup_teaches_expert_moves_on_unseen_layouts(tmp_path):
  """The grid's SFT examples are expert episodes cut at a turn, in the agent's chat format: replaying
  the history's replies on a fresh environment of the same seed must reproduce the last board shown,
  and the answer must be the expert's move from there (a history out of step with its boards, or a
  label one turn late, fails). Several examples are cut mid-episode; a warm-up of a few steps runs
  and compiles its step once (its widths were once rounded per batch)."""
  cfg = _cfg(
    tmp_path,
    "env.name=grid",
    "rollout.max_seq_len=256",
    "train.warmup_sft_steps=4",
    "train.sft_batch_size=2",  # small batches: their longest histories differ (checked below)
    "train.steps=1",
  )
  trainer = agent.make_run(cfg)
  try:
    decode = trainer.setup.tokenizer.decode
    later = 0
    for i in range(20):
      prompt, answer = trainer.program.sft_pair(i)
      text = decode(prompt)
      assert text.count(GRID_SYSTEM) == 1 and text.endswith("assistant\n")
      turns = text.split("\nuser\n")[1:]  # each: board [+ question], assistant header, reply
      replies = [t.split("assistant\n")[1].strip() for t in turns[:-1]]
      env = trainer.program.env_factory()
      env.reset(GRID_WARMUP_SEEDS + i)
      for move in replies:
        assert move in ("up", "down", "left", "right"), move
        env.step(move)
      assert turns[-1].startswith(env.render())
      assert decode(answer).replace("<|im_end|>", "").strip() == env.best_move()
      later += bool(replies)
    assert 0 < later < 20
    # widths fixed over the warm-up's examples: one compile, where widths rounded per batch differ
    per_batch = {
      -(-max(len(trainer.program.sft_pair(2 * b + j)[0]) for j in (0, 1)) // 32) for b in range(4)
    }
    assert len(per_batch) > 1, per_batch
    with compiled_functions() as names:
      trainer.sft(4, progress=False)
    assert names.count("jit(train_step)") == 1, names
  finally:
    trainer.close()
  rows = [r for r in read_metrics(str(tmp_path)) if "sft/loss" in r]
  assert len(rows) == 4 and all(np.isfinite(r["sft/loss"]) for r in rows)


def test_resume_restores_the_value_head(tmp_path):
  """A checkpoint holds the value head and its optimizer state; --resume takes them back (a run that
  resumed with a fresh, zero value head would train its critic from scratch without a word)."""
  cfg = _cfg(tmp_path, "train.algorithm=ppo", "train.steps=2", "run.checkpoint_every=1")
  first = agent.make_run(cfg, AsciiEnv, "Be brief.")
  try:
    first.run()
  finally:
    first.close()
  assert (
    float(np.abs(first.program.head_params["proj"]["kernel"][...]).sum()) > 0
  )  # trained away from 0
  cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
  second = agent.make_run(cfg, AsciiEnv, "Be brief.")
  try:
    assert second.resume() == 2
    pick = lambda t: (t.program.head_params, t.program.head_opt_state, t.policy.params)
    saved, restored = pick(first), pick(second)
    jax.tree.map(np.testing.assert_array_equal, saved, restored)
  finally:
    second.close()


def test_refused_configs(tmp_path):
  with pytest.raises(ConfigError, match=r"train\.critic_preset=qwen9"):
    agent.make_run(_cfg(tmp_path, "train.critic=model", "train.critic_preset=qwen9"), AsciiEnv)


def test_config_keys_are_checked():
  for override, key in (
    ("train.algorithm=a2c", "train.algorithm"),
    ("train.gamma=1.5", "train.gamma"),
    ("train.gae_lambda=-0.1", "train.gae_lambda"),
    ("train.vf_coef=-1", "train.vf_coef"),
    ("train.value_clip=0", "train.value_clip"),
    ("env.name=chess", "env.name"),
    ("env.max_turns=0", "env.max_turns"),
    ("env.grid_holes=14", "env.grid_holes"),
    ("env.grid_observation=pixels", "env.grid_observation"),
    ("train.critic=mlp", "train.critic"),
    ("train.critic_preset=tiny", "train.critic_preset"),
  ):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
      cli.parse_args([override])
  cfg = cli.parse_args(["--config", "configs/cpu-multiturn.yaml"])
  assert cfg.train.algorithm == "ppo" and cfg.env.name == "calc"
  assert dataclasses.replace(cfg.env, name="grid").name == "grid"
  assert cli.parse_args(["--config", "configs/cpu-grid.yaml"]).env.name == "grid"
  assert cli.parse_args(["env.grid_observation=safe"]).env.grid_observation == "safe"


_RUN_ASCII = (
  "import sys; from rl import cli; from rl.agent import __main__ as agent; from tests.rl.agent.test_env_agent import AsciiEnv; "
  "cfg = cli.parse_args(sys.argv[1:]); cli.start_process(cfg); "
  "t = agent.make_run(cfg, AsciiEnv, 'Be brief.'); t.run(); t.close()"
)


def test_two_processes_match_one(tmp_path):
  """Two local processes (gloo collectives, one CPU device each) == one process with two devices:
  each rolls out its share of the episodes, GAE runs on its own rows, whitening, explained variance
  and the episode metrics are over both, the update is on the global batch; eval's 3 problems split
  2 + 1 (unequal shares gathered without counting the padding)."""
  root = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  )
  common = [
    "model.preset=tiny",
    "rollout.max_seq_len=384",  # eval: calc problems under the GSM8K system prompt
    "rollout.max_slots=16",
    "rollout.page_size=8",
    "sampling.group_size=2",
    "sampling.max_new_tokens=6",
    "train.algorithm=ppo",
    "train.prompts_per_step=4",
    "train.micro_batch_size=4",
    "train.learning_rate=3e-3",
    "train.ppo_epochs=2",
    "train.loss_type=dapo",
    "train.steps=2",
    "train.whiten_advantages=true",
    "data.synthetic_train=20",
    "data.synthetic_test=4",
    "eval.full_at_end=true",
    "eval.batch=3",
    "run.progress=false",
    "run.tensorboard=false",
    "mesh.fsdp=2",
  ]
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=root, XLA_FLAGS=one_device_xla_flags())
  run = lambda *args: subprocess.Popen(
    [sys.executable, "-c", _RUN_ASCII, *common, *args],
    cwd=root,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  procs = [
    run(
      f"run.out_dir={tmp_path / 'multi'}",
      "run.host_devices=1",
      "dist.initialize=true",
      f"dist.coordinator_address=localhost:{port}",
      "dist.num_processes=2",
      f"dist.process_id={i}",
    )
    for i in range(2)
  ]
  single = run(f"run.out_dir={tmp_path / 'single'}", "run.host_devices=2")
  for p in (*procs, single):
    out = p.communicate(timeout=900)[0]
    assert p.returncode == 0, out[-3000:]
  a, b = read_metrics(str(tmp_path / "single")), read_metrics(str(tmp_path / "multi"))
  assert [r["step"] for r in b] == [0, 1, 2]  # only process 0 writes
  for x, y in zip(a, b):
    assert x.get("eval_full/examples") == y.get("eval_full/examples")
    for key in ("eval_full/accuracy", "eval_full/reward_mean"):
      np.testing.assert_allclose(y.get(key, np.nan), x.get(key, np.nan), rtol=1e-6, err_msg=key)
  assert b[-1]["eval_full/examples"] == 3
  for x, y in zip(a[1:], b[1:]):
    assert x["rollout/generated_tokens"] == y["rollout/generated_tokens"]
    for key in ("env/success_rate", "env/reward_mean"):  # the gather goes through float32
      np.testing.assert_allclose(y[key], x[key], rtol=1e-6, err_msg=key)
    for key in ("train/loss", "critic/value_loss", "critic/explained_variance", "train/grad_norm"):
      np.testing.assert_allclose(y[key], x[key], rtol=1e-4, atol=1e-6, err_msg=key)
  # the update had a signal to get wrong: a non-zero policy gradient and value loss
  assert b[1]["train/grad_norm"] > 0 and b[1]["critic/value_loss"] > 0


class SpreadEnv:
  """Episodes whose lengths spread widely from step to step: first prompts of 0 to 24 extra
  characters, 1 to 3 turns, observations as long as 4x the reply. Rounded per step, its packed widths
  change from step to step (the test checks that they would)."""

  max_turns = 3

  def reset(self, seed):
    self.turn, self.turns = 0, 1 + seed % 3
    return "go" + " on" * (seed % 9)

  def step(self, action):
    self.turn += 1
    done = self.turn >= self.turns
    return StepResult("x" * (4 * len(action)), 1.0, done, {"success": True} if done else {})


def test_episode_widths_are_fixed_up_front_so_later_steps_do_not_recompile(tmp_path):
  """Six PPO steps with the KL term on (the pre-update pass, the reference log-probs, GAE, the
  update) on episodes whose lengths spread over several 32-token buckets: after the first step none
  of them compiles again. Catches widths rounded per step
  (rl.agent before issue 31's fix: a long run recompiled the update whenever episodes grew), and any
  other per-step shape reaching the update."""
  cfg = _cfg(
    tmp_path,
    "train.algorithm=ppo",
    "train.beta=0.1",
    "train.steps=6",
    "sampling.group_size=2",
    "train.prompts_per_step=2",
    "train.micro_batch_size=2",
    "rollout.max_seq_len=160",
  )
  run = agent.make_run(cfg, SpreadEnv, "Be brief.")
  program, episodes_of = run.program, run.program.episodes
  seen = []  # per step: (longest first prompt, longest rest) of its episodes

  def episodes(*args):
    eps, stats = episodes_of(*args)
    seen.append((max(e.prompt_len for e in eps), max(len(e.tokens) - e.prompt_len for e in eps)))
    return eps, stats

  program.episodes = episodes
  pw, cw = program.widths
  assert pw % 32 == 0 and cw % 32 == 0 and pw + cw <= 2 * 160
  # the update, the pre-update pass, the reference pass and GAE (an eager lax.scan once compiled a
  # `scan` every step)
  watched = {"jit(update_step)", "jit(old_logps_and_values)", "jit(batch_token_logps)", "jit(_gae)"}
  try:
    for step in range(6):
      with compiled_functions() as names:
        row = run.step(step)
      assert row["time/train/compiles"] == len(names), (step, names)
      if step == 0:
        assert watched <= set(names), names
      else:
        assert not (watched | {"jit(scan)"}) & set(names), (step, names)
  finally:
    run.close()
  # the episodes did spread: widths rounded per step (the old rule) would have changed
  per_step = {(-(-p // 32), -(-r // 32)) for p, r in seen}
  assert len(per_step) > 1, seen
  assert all(p <= pw and r <= cw for p, r in seen)
