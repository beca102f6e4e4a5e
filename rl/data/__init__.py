"""Task data: GSM8K jsonl and the synthetic GSM8K-format generator, both as `Example`s."""

from rl.data.gsm8k import Example, gold_answer, load_gsm8k
from rl.data.synthetic import generate as generate_synthetic

__all__ = ["Example", "generate_synthetic", "gold_answer", "load_gsm8k"]
