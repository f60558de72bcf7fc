"""A tiny randomly initialised model, tokenizer and chat dataset, built on the spot.

Used by the demo, the tests and the CPU benchmark so that nothing is ever downloaded. The model is saved
and then loaded back through the same path as a real checkpoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same rendering without generation markers (as Qwen's own templates are): exercises the fallback.
CHATML_TEMPLATE_NO_MARKERS = CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MODEL_KINDS = ("qwen3_5_text", "qwen3_5", "llama", "qwen3")


def _words(count: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "pra", "den", "qua", "zel", "ox", "im", "ber"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(count)]


WORDS = _words(300)


def build_tokenizer(out_dir: Path, generation_markers: bool = True, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on synthetic text and save it with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(40)) + " 0123456789 .,?!" for _ in range(400)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE if generation_markers else CHATML_TEMPLATE_NO_MARKERS
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def tiny_config(kind: str, vocab_size: int, num_layers: int = 8, hidden_size: int = 64):
    """A tiny transformers config of model family `kind` (random weights are made from it)."""
    from transformers import LlamaConfig, Qwen3_5Config, Qwen3_5TextConfig, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=8192, pad_token_id=0, eos_token_id=2, tie_word_embeddings=False,
    )
    hybrid: dict[str, Any] = dict(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        full_attention_interval=4,
    )
    if kind == "qwen3_5_text":
        return Qwen3_5TextConfig(**common, **hybrid)
    if kind == "qwen3_5":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size)
        return Qwen3_5Config(text_config={**common, **hybrid}, vision_config=vision)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "qwen3":
        return Qwen3Config(**common)
    raise ValueError(f"unknown tiny model kind {kind!r}; choose from {MODEL_KINDS}")


def build_model(out_dir: Path, kind: str = "qwen3_5_text", num_layers: int = 8, hidden_size: int = 64,
                generation_markers: bool = True, seed: int = 0) -> Path:
    """Save a randomly initialised model of `kind` plus the tiny tokenizer into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    tokenizer = build_tokenizer(out_dir, generation_markers=generation_markers)
    config = tiny_config(kind, len(tokenizer), num_layers, hidden_size)
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    return out_dir


def make_conversation(rng: random.Random, sample_id: str | None, turns: int, words_per_turn: int) -> dict:
    """A random chat record: user and assistant turns of random words."""
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "you are " + " ".join(rng.choices(WORDS, k=3))})
    for _ in range(turns):
        for role in ("user", "assistant"):
            n = max(2, int(rng.lognormvariate(0, 0.6) * words_per_turn))
            messages.append({"role": role, "content": " ".join(rng.choices(WORDS, k=n))})
    record: dict = {"messages": messages}
    if sample_id is not None:
        record = {"id": sample_id, **record}
    return record


def build_dataset(path: Path, num_samples: int, seed: int = 0, words_per_turn: int = 12) -> Path:
    """Write a JSONL chat dataset of `num_samples` conversations with mixed lengths."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for n in range(num_samples):
            record = make_conversation(rng, f"s{n:06d}", rng.randint(1, 3), words_per_turn)
            handle.write(json.dumps(record) + "\n")
    return path
