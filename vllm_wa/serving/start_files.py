"""The files ``--wa-config`` and ``--wa-params`` name, and the config's ``seed_params``, read once.

The API server validates them at start-up; the engine cores, spawned later,
load the parameters and config they name.  Read twice, a pipe
(``--wa-config <(render)``) gives its content only once, and a file edited
in between starts the engine on content nobody checked, which fails inside
vLLM's scheduler instead of refusing to start.  So the API server reads each
file once, validates those bytes, and hands the engines a private copy of
them: every process runs what was checked.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_folder: str | None = None


def private_copy(data: bytes, name: str) -> str:
    """Write ``data`` to ``name`` in this process's private folder (mode 0700,
    removed at exit) and return its absolute path."""
    global _folder
    if _folder is None:
        _folder = tempfile.mkdtemp(prefix="vllm-wa-start-")
        atexit.register(shutil.rmtree, _folder, ignore_errors=True)
    path = os.path.join(_folder, name)
    with open(path, "wb") as f:
        f.write(data)
    return path
