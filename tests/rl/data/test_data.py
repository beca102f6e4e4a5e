"""GSM8K loading (the real files beside the checkout) and the synthetic generator."""

import json
import pathlib
import re

import pytest

from rl.data import generate_synthetic, gold_answer, load_gsm8k
from rl.data import gsm8k as gsm8k_module
from rl.data.rewards import correctness_reward, format_reward

GSM8K = pathlib.Path(__file__).resolve().parents[4] / "shared" / "data" / "gsm8k"
needs_gsm8k = pytest.mark.skipif(
  not (GSM8K / "test.jsonl").exists(), reason=f"GSM8K not at {GSM8K}"
)


@needs_gsm8k
def test_real_gsm8k_splits():
  test, train = load_gsm8k(GSM8K, "test"), load_gsm8k(GSM8K, "train")
  assert (len(train), len(test)) == (7473, 1319)  # the published split sizes
  assert test[0].gold == "18"  # Janet's ducks
  for ex in train + test:  # every gold answer scores 1 on its own worked solution
    assert correctness_reward(ex.answer, ex.gold) == 1.0
  assert len(load_gsm8k(GSM8K / "test.jsonl", limit=5)) == 5


@needs_gsm8k
def test_gsm8k_is_found_without_a_path():
  """`data.dataset=gsm8k` alone: the copy beside the checkout is the default directory."""
  assert pathlib.Path(gsm8k_module.default_dir()) == GSM8K


def test_no_default_gsm8k_directory_names_the_places_searched(tmp_path, monkeypatch):
  monkeypatch.setattr(gsm8k_module, "DEFAULT_DIRS", (str(tmp_path / "a"), str(tmp_path / "b")))
  with pytest.raises(FileNotFoundError, match=r"none found at .*a or .*b .*set data\.path"):
    gsm8k_module.default_dir()


def test_gold_normalisation_and_errors(tmp_path):
  assert gold_answer("so\n#### 1,200") == "1200"
  assert gold_answer("#### $3.50") == "3.5"
  assert gold_answer("#### 7.0") == "7"
  with pytest.raises(ValueError, match="####"):
    gold_answer("no final answer")
  bad = tmp_path / "train.jsonl"
  bad.write_text(
    json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q"}) + "\n"
  )
  with pytest.raises(ValueError, match=r"train\.jsonl:2"):
    load_gsm8k(tmp_path, "train")
  with pytest.raises(ValueError, match="split"):
    load_gsm8k(tmp_path)
  with pytest.raises(FileNotFoundError):
    load_gsm8k(tmp_path, "test")


def test_synthetic_is_seeded_correct_and_leveled():
  a, b = generate_synthetic(200, seed=3), generate_synthetic(200, seed=3)
  assert a == b and a != generate_synthetic(200, seed=4)
  for ex in a:
    assert correctness_reward(ex.answer, ex.gold) == 1.0 and format_reward(ex.answer) == 1.0
    steps = ex.answer.splitlines()[:-1]
    value = None
    for line in steps:  # every equation line is true arithmetic
      lhs, rhs = line.split(" = ")
      assert eval(lhs) == int(rhs)
      value = int(rhs)
    assert str(value) == ex.gold and int(ex.gold) >= 0
  assert {len(ex.answer.splitlines()) - 1 for ex in generate_synthetic(100, 0, levels=(2,))} == {2}
  for ex in generate_synthetic(50, 0, levels=(0,)):  # level 0: the stated number, copied
    (stated,) = re.findall(r"\d+", ex.question)
    assert ex.answer == f"#### {stated}" and ex.gold == stated
  with pytest.raises(ValueError, match="level"):
    generate_synthetic(1, 0, levels=(4,))
