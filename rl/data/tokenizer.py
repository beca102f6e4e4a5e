"""Tokenizers: HF `tokenizers` from a local `tokenizer.json`, and an embedded byte-level one that needs no
files. Both speak Qwen's ChatML chat format and share one interface, so the loop never asks which it has.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Protocol

from rl.configlib import read_json_object

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "chatml", "load_tokenizer"]

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


def chatml(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
  """Qwen's chat template (ChatML): `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then the
  assistant header when a reply is to be generated."""
  parts = []
  for message in messages:
    role = message.get("role")
    if role not in ("system", "user", "assistant"):
      raise ValueError(f"chat message role must be system/user/assistant, got {role!r}")
    parts.append(f"{IM_START}{role}\n{message['content']}{IM_END}\n")
  if add_generation_prompt:
    parts.append(f"{IM_START}assistant\n")
  return "".join(parts)


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  eos_ids: tuple[int, ...]  # generation stops at any of these

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

  def apply_chat_template(
    self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
  ) -> str: ...


class ByteTokenizer:
  """The embedded default: UTF-8 bytes (ids 0-255) plus Qwen's three special tokens. Lossless on any text."""

  SPECIALS = (END_OF_TEXT, IM_START, IM_END)

  def __init__(self):
    self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
    self.vocab_size = 256 + len(self.SPECIALS)
    self.pad_id = self.special_ids[END_OF_TEXT]
    self.eos_ids = (self.special_ids[IM_END], self.special_ids[END_OF_TEXT])
    self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")

  def encode(self, text: str) -> list[int]:
    ids: list[int] = []
    for piece in self._split.split(text):
      if piece in self.special_ids:
        ids.append(self.special_ids[piece])
      elif piece:
        ids.extend(piece.encode("utf-8"))
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    names = {v: k for k, v in self.special_ids.items()}
    out, buf = [], bytearray()
    for i in ids:
      i = int(i)
      if 0 <= i < 256:
        buf.append(i)
        continue
      out.append(buf.decode("utf-8", errors="replace"))
      buf = bytearray()
      if i in names and not skip_special_tokens:
        out.append(names[i])
      elif i not in names:
        out.append("\ufffd")  # an id the model may emit past the byte range (its vocab is padded)
    out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)

  def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
    return chatml(messages, add_generation_prompt)


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer read from a local directory (`tokenizer.json`, and optionally
  `tokenizer_config.json` / `generation_config.json` for the EOS and pad tokens)."""

  def __init__(self, directory: str | os.PathLike):
    from tokenizers import Tokenizer as _HF  # imported here: only real checkpoints need it

    directory = os.fspath(directory)
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"no tokenizer.json in {directory}")
    try:
      self._tok = _HF.from_file(path)
    except Exception as e:  # the tokenizers library raises plain Exceptions
      raise ValueError(
        f"{path} is not a readable tokenizer ({e}): truncated or half-written?"
      ) from e
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    generation = _read_json(os.path.join(directory, "generation_config.json"))
    eos = []
    gen_eos = generation.get("eos_token_id")
    eos.extend(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    for token in (_token_text(config.get("eos_token")), IM_END, END_OF_TEXT):
      if token is not None and self._tok.token_to_id(token) is not None:
        eos.append(self._tok.token_to_id(token))
    if not eos:
      raise ValueError(
        f"{directory}: no EOS token found (tokenizer_config.json eos_token, <|im_end|> or "
        "<|endoftext|>)"
      )
    self.eos_ids = tuple(dict.fromkeys(int(e) for e in eos))
    pad = _token_text(config.get("pad_token"))
    pad_id = self._tok.token_to_id(pad) if pad is not None else None
    self.pad_id = int(pad_id) if pad_id is not None else self.eos_ids[-1]

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
    return chatml(messages, add_generation_prompt)


def _read_json(path: str) -> dict:
  """An optional JSON file ({} when absent); a truncated one is a ValueError naming it."""
  return read_json_object(path) if os.path.exists(path) else {}


def _token_text(token) -> str | None:
  """tokenizer_config.json writes special tokens as strings or as {"content": ...} dicts."""
  return token.get("content") if isinstance(token, dict) else token


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
  """`None` or "embedded": the byte tokenizer; otherwise a directory holding `tokenizer.json`."""
  if path is None or path == "embedded":
    return ByteTokenizer()
  return HFTokenizer(path)
