"""A tiny random Llama with a character-level text tokenizer and a thinking chat template.

For CPU tests of the math-jsonl task (docs/math.md): it runs the task's whole path (chat
template, left-padded prompts of different lengths, a thinking block, boxed-answer scoring) in
seconds. It is untrained, so its reward is about 0. Built offline with the `tokenizers` library:

    python tests/math_tiny.py OUT_DIR

The tokenizer has one token per printable ASCII character (plus newline and tab), special tokens
for the chat roles and the thinking block, and `<unk>` for anything else. Its chat template
renders a conversation as `<|user|>...</s><|assistant|><think>`, so generation starts inside
the thinking block.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from recipe.model.policy import TinyLlamaShape, build_tiny_llama

PAD, UNK, EOS = "<pad>", "<unk>", "</s>"
SPECIAL = (PAD, UNK, EOS, "<think>", "</think>", "<|system|>", "<|user|>", "<|assistant|>")
CHARACTERS = tuple(sorted(set(string.printable) - set("\r\x0b\x0c")))
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
)
SHAPE = TinyLlamaShape(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=1, head_dim=64, max_positions=1024
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; the special tokens are matched whole, before the split."""
    vocabulary = {symbol: i for i, symbol in enumerate((*SPECIAL, *CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(SPECIAL[3:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_math_tiny(out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny model and its tokenizer to `out_dir` (a Hugging Face model directory)."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(SHAPE, tokenizer, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/math_tiny.py OUT_DIR")
    print(build_math_tiny(Path(sys.argv[1])))
