"""Tiny random-weight models and a locally trained tokenizer (nothing is downloaded)."""

from vllm_wa.bench.tiny_model import build_tiny_hybrid_model, build_tiny_model

__all__ = ["build_tiny_hybrid_model", "build_tiny_model"]
