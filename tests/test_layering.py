"""The packages import one way: shared pieces at the bottom, the clients on top.

``sim`` and the top-level modules (``kv_block``, ``params``, ...) are below
everything; ``engine_patch`` patches vLLM; ``controller`` drives the patched
queue; ``replay`` and ``serving`` both run the controller and never import
each other; ``bench`` is a client of them all, and ``cli`` the entry point.
Every import counts, those inside functions too: a lazy import that points up
is the same cycle, only hidden.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_wa

PACKAGE = Path(vllm_wa.__file__).parent
RANK = {"sim": 1, "engine_patch": 2, "controller": 3, "replay": 4, "serving": 4, "bench": 5, "cli": 6}


def layer(module: str) -> str:
    """The layer of ``vllm_wa.x.y``: the subpackage ``x``, or ``base`` for a top-level module."""
    parts = module.split(".")
    if len(parts) < 2:
        return "base"
    return parts[1] if parts[1] in RANK else "base"


def imports(path: Path) -> list[tuple[int, str]]:
    """Every ``vllm_wa`` module ``path`` imports (line, module), at any depth of the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("vllm_wa"):
            if node.module == "vllm_wa":  # from vllm_wa import fileio, ...
                found += [(node.lineno, f"vllm_wa.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("vllm_wa")]
    return found


def wrong_way(module: str, target: str) -> bool:
    src, dst = layer(module), layer(target)
    if src == dst or dst == "base":
        return False
    if src == "base":
        return True
    return RANK[dst] >= RANK[src]


def test_every_import_points_down_and_replay_and_serving_stay_apart():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("vllm_wa", *path.relative_to(PACKAGE).with_suffix("").parts))
        bad += [f"{path.relative_to(PACKAGE)}:{line} imports {target}"
                for line, target in imports(path) if wrong_way(module, target)]
    assert bad == []


def test_the_rule_catches_an_import_that_points_up():
    assert wrong_way("vllm_wa.replay.served", "vllm_wa.bench.results")  # the cycle before served_format
    assert wrong_way("vllm_wa.replay.runner", "vllm_wa.serving.settings")  # peers on one layer
    assert wrong_way("vllm_wa.engine_patch.install", "vllm_wa.controller.config")
    assert wrong_way("vllm_wa.params", "vllm_wa.sim.clock")
    assert not wrong_way("vllm_wa.controller.controller", "vllm_wa.engine_patch.events")
    assert not wrong_way("vllm_wa.bench.client", "vllm_wa.served_format")
    assert not wrong_way("vllm_wa.cli", "vllm_wa.bench.cli")
