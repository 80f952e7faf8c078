"""The name and version of the JSON file ``vllm-wa bench-serve`` writes.

The benchmark client writes it (:mod:`vllm_wa.bench.results`) and the replay
reads it (:mod:`vllm_wa.replay.served`); both take the names from here, so
neither package imports the other for them.
"""

FORMAT = "vllm-wa-bench-serve"
VERSION = 1
