"""vllm-wa: an online, self-tuning, workload-aware KV-cache eviction policy for vLLM."""

from vllm_wa.params import ParamsError, ReuseModel, WAParams

__version__ = "0.1.0"
__all__ = ["ParamsError", "ReuseModel", "WAParams", "__version__"]
