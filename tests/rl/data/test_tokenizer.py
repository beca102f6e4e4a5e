"""Tokenizers: the embedded byte tokenizer and a real HF tokenizer.json written here, one interface."""

import json
import re
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.data.prompts import TEMPLATES, PromptTemplate
from rl.data.tokenizer import (
  END_OF_TEXT,
  IM_END,
  IM_START,
  ByteTokenizer,
  HFTokenizer,
  chatml,
  load_tokenizer,
)

SPECIALS = [END_OF_TEXT, IM_START, IM_END]


@settings(max_examples=400)  # pure Python and cheap: the global 8-example cap is for kernels
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids, skip_special_tokens=False) == text


def test_byte_tokenizer_specials_are_single_tokens():
  tok = ByteTokenizer()
  ids = tok.encode(f"{IM_START}user\nhi{IM_END}")
  assert ids[0] == tok.special_ids[IM_START] and ids[-1] == tok.special_ids[IM_END]
  assert len(ids) == 2 + len("user\nhi")
  assert tok.decode(ids) == "user\nhi"
  # Generation stops at end-of-turn first, end-of-text too (what Qwen's generation_config lists).
  assert tok.eos_ids == (tok.special_ids[IM_END], tok.special_ids[END_OF_TEXT])
  assert (
    tok.decode([72, 105, 300]) == "Hi\ufffd"
  )  # an id past the byte range never vanishes silently
  assert (
    load_tokenizer(None).vocab_size == tok.vocab_size <= 384
  )  # fits the embedded presets' vocab


def test_chatml_is_qwens_format():
  text = chatml([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])
  assert (
    text
    == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
  )
  with pytest.raises(ValueError, match="role"):
    chatml([{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  directory = tmp_path_factory.mktemp("tok")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  corpus = [
    "Natalia sold clips to 48 of her friends in April.",
    "How many apples does Ann have? #### 12",
  ] * 50
  tok.train_from_iterator(corpus, trainer)
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(
    json.dumps({"eos_token": {"content": IM_END}, "pad_token": END_OF_TEXT})
  )
  return directory


def test_hf_tokenizer_from_a_local_directory(hf_dir):
  tok = load_tokenizer(hf_dir)
  assert isinstance(tok, HFTokenizer)
  text = PromptTemplate().render("Ann has 3 apples. How many?", tok)
  ids = tok.encode(text)
  assert tok.decode(ids, skip_special_tokens=False) == text
  im_end = tok._tok.token_to_id(IM_END)
  assert ids.count(im_end) == 2 and tok.eos_ids[0] == im_end
  assert tok.pad_id == tok._tok.token_to_id(END_OF_TEXT)
  assert tok.decode(ids).startswith("system\n")  # specials skipped


def test_hf_tokenizer_errors(tmp_path, hf_dir):
  with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
    HFTokenizer(tmp_path)
  # Truncated files (a half-finished download): the error names the file.
  for name in ("tokenizer.json", "tokenizer_config.json"):
    broken = tmp_path / name.split(".")[0]
    shutil.copytree(hf_dir, broken)
    text = (broken / name).read_text()
    (broken / name).write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=re.escape(str(broken / name))):
      load_tokenizer(broken)


def test_prompt_template_is_the_same_for_any_tokenizer(hf_dir):
  for template in TEMPLATES.values():
    for tok in (ByteTokenizer(), load_tokenizer(hf_dir)):
      rendered = template.render("  What is 2 + 2?\n", tok)
      assert rendered.endswith(
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
      )
      assert template.system in rendered
