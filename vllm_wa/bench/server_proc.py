"""Start and stop the ``vllm serve`` processes a benchmark suite compares.

Both servers of a comparison get the same model, block size, KV-cache size
(``--num-gpu-blocks-override``), context length and batch size; the
``--wa-online`` one differs only by the vllm-wa flags.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM a server started with ``start_new_session`` and everything in
    its process group (vLLM's engine cores), SIGKILL what is left after
    ``grace_s``.  Also when the leader has already exited: a crashed API
    server leaves its engine core holding the (GPU) memory the next server needs.
    """
    group = proc.pid
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        proc.poll()
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(group):
            return
        time.sleep(0.1)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside, SIGTERM raises ``KeyboardInterrupt`` (as Ctrl-C does), so
    ``finally`` blocks stop the servers and write what was measured; Python's
    default action ends the process at once, leaving both undone.  Outside the
    main thread (where no handler can be set) it changes nothing."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        before = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerSpec:
    """One ``vllm serve`` command line."""

    model: str
    block_size: int
    max_model_len: int
    num_blocks: int
    max_num_seqs: int
    wa_online: bool = False
    wa_config: str | None = None
    served_name: str = "bench"
    host: str = "127.0.0.1"
    port: int = 8000
    cpu: bool = True
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self, vllm: str = "vllm") -> list[str]:
        cmd = [
            vllm, "serve", self.model, "--served-model-name", self.served_name,
            "--host", self.host, "--port", str(self.port),
            "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
            "--num-gpu-blocks-override", str(self.num_blocks), "--max-num-seqs", str(self.max_num_seqs),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-per-request-metrics",
        ]
        if self.cpu:
            cmd.append("--enforce-eager")
        if self.wa_online:
            cmd += ["--wa-online", "--wa-bench-outcome-hints"]
            if self.wa_config:
                cmd += ["--wa-config", self.wa_config]
        return cmd + list(self.extra_args)

    def env_overrides(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": "1"} if self.cpu else {}

    def shell(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env_overrides().items())
        return (env + " " if env else "") + shlex.join(self.argv())


@dataclass
class ServerProcess:
    """A running server; ``stop()`` ends its whole process group."""

    spec: ServerSpec
    log_path: str
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0
    _log: object = field(default=None, repr=False)

    def start(self, env: dict[str, str] | None = None, timeout_s: float = 600.0) -> ServerProcess:
        vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
        full_env = dict(os.environ if env is None else env)
        full_env.update(self.spec.env_overrides())
        for k in [k for k in full_env if k.startswith("VLLM_WA_")]:
            full_env.pop(k)  # the flags decide, not a stale environment
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.spec.argv(vllm), stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}); log {self.log_path}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.spec.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - t0
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not start in {timeout_s:.0f} s; log {self.log_path}:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
