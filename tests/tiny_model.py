"""A tiny random-weight Llama and a locally trained tokenizer (nothing is downloaded)."""

from vllm_wa.bench.tiny_model import build_tiny_model

__all__ = ["build_tiny_model"]
