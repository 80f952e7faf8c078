"""``vllm-wa bench-serve``: replay a trace through a live vLLM server's OpenAI API."""
