"""Tiny random-weight models and a locally trained tokenizer (nothing is downloaded).

What the CPU tests and ``make bench-serve`` serve: it exercises vLLM's whole
serving path (scheduler, prefix cache, API server) in milliseconds per step.
Its replies are noise; its timings measure vLLM's overheads, not a model.
"""

from __future__ import annotations

import json
import os
from typing import Any

VOCAB_SIZE = 512  # the tokenizer's 400 tokens and room to spare; prompts use ids below 400


def _built(out: str, max_position_embeddings: int) -> bool:
    """Whether ``out`` already holds a model with enough positions and its tokenizer."""
    try:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            enough = json.load(f).get("max_position_embeddings", 0) >= max_position_embeddings
    except (OSError, ValueError):
        return False
    return enough and os.path.exists(os.path.join(out, "tokenizer.json"))


def _write_tokenizer(out: str) -> None:
    """A 400-token byte-level BPE trained on a few lines, with a plain chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    corpus = [
        "the quick brown fox jumps over the lazy dog " * 4,
        "user assistant system tool call function arguments result " * 4,
        "def main return print import class self value list dict " * 4,
    ]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(out)


# What both tiny models share: two layers, head_dim 64 (CPU attention needs >= 32).
_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def _build(out: str, max_position_embeddings: int, model_cls: Any, config_cls: Any, **config: Any) -> str:
    """Write the tokenizer and a seeded random-weight model (reused when already there)."""
    if _built(out, max_position_embeddings):
        return out
    import torch

    _write_tokenizer(out)
    cfg = config_cls(**_SHAPE, max_position_embeddings=max_position_embeddings, **config)
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(out)
    return out


def build_tiny_model(out: str, max_position_embeddings: int = 2048) -> str:
    """Write the model to ``out`` (reused when it is already there with enough positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(out, max_position_embeddings, LlamaForCausalLM, LlamaConfig, tie_word_embeddings=False)


def build_tiny_hybrid_model(out: str, sliding_window: int = 64, max_position_embeddings: int = 2048) -> str:
    """A tiny random-weight Gemma 3 text model: a sliding-window layer, then a
    full-attention one, so vLLM runs two KV-cache groups and frees the window's
    blocks while a request still runs (what Gemma 3 and gpt-oss do)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _build(
        out,
        max_position_embeddings,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        head_dim=64,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=sliding_window,
        pad_token_id=0,
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m vllm_wa.bench.tiny_model DIR [--hybrid]``: a model to ``vllm serve DIR`` on a CPU."""
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random-weight model and its tokenizer (nothing is downloaded).")
    ap.add_argument("out", metavar="DIR")
    ap.add_argument("--hybrid", action="store_true", help="a Gemma 3 text model with a sliding-window layer")
    ap.add_argument("--max-position-embeddings", type=int, default=2048)
    args = ap.parse_args(argv)
    build = build_tiny_hybrid_model if args.hybrid else build_tiny_model
    print(build(args.out, max_position_embeddings=args.max_position_embeddings))


if __name__ == "__main__":
    main()
