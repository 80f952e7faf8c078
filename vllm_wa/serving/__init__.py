"""``vllm serve --wa-online``: the vLLM plugin, /wa/params, metrics."""
