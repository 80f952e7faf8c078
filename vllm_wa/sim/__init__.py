"""Simulation pieces shared by the controller's miniature caches and the replay.

They sit below every other package: the same settable clock and the same
block-level model of vLLM's prefix-caching pool serve ``vllm-wa replay``'s fast
engine and the candidates' miniature caches, so both measure one thing.
"""
