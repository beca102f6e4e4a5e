"""The prompt template: system prompt + question -> chat prompt. Train and eval both render through this."""

from __future__ import annotations

import dataclasses

from rl.data.tokenizer import Tokenizer

GSM8K_SYSTEM = (
  "You are a careful math tutor. Reason step by step, then write the final answer on its own "
  "line as '#### <number>'."
)
# The embedded byte-level model pays one token per character: a short system prompt keeps prompts short.
COMPACT_SYSTEM = "Solve. End with #### <answer>."


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
  system: str = GSM8K_SYSTEM

  def messages(self, question: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": self.system}] if self.system else []
    return msgs + [{"role": "user", "content": question.strip()}]

  def render(self, question: str, tokenizer: Tokenizer) -> str:
    return tokenizer.apply_chat_template(self.messages(question), add_generation_prompt=True)

  def encode(self, question: str, tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(self.render(question, tokenizer))


TEMPLATES = {"gsm8k": PromptTemplate(GSM8K_SYSTEM), "compact": PromptTemplate(COMPACT_SYSTEM)}
