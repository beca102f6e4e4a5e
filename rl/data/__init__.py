"""Task text: GSM8K jsonl and the synthetic GSM8K-format generator, both as `Example`s (exported
here); the prompt template that renders a question (rl.data.prompts), the tokenizers that turn text
into tokens (rl.data.tokenizer) and the rewards that score a completion's text (rl.data.rewards)."""

from rl.data.gsm8k import Example, gold_answer, load_gsm8k
from rl.data.synthetic import generate as generate_synthetic

__all__ = ["Example", "generate_synthetic", "gold_answer", "load_gsm8k"]
