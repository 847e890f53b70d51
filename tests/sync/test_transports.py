"""sync/transports.py is the one place the package builds a weight transport (issue 31): a transport built
elsewhere (a default, an agent's own buffers) escapes the choice `sync.transport` makes and the checks the one
place keeps, and a new transport would have to be wired into every such place by hand."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "moe_grpo"
THE_ONE_PLACE = PACKAGE / "sync" / "transports.py"
# What transports.py builds: each host's buffers (shared memory, CUDA IPC), a learner rank's relaying publisher,
# and the two ends of the shard relay that fills another host's buffers.
TRANSPORT_CLASSES = {"SharedMemoryTransport", "CudaIpcTransport", "RelayPublisher", "ShardSender", "ShardReceiver"}


def _subclasses_of_transports() -> set[str]:
    """Classes in the package derived from a transport class: they are transports too (CudaIpcTransport is)."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & TRANSPORT_CLASSES:
                    found.add(node.name)
    return found


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def test_the_package_builds_transports_only_in_sync_transports():
    """Would have caught `SharedMemoryTransport(...)` in orchestrator/sync_hosts.py (a relay host's buffers),
    `WeightSync`'s default transport in sync/weight_sync.py and `ShardReceiver(...)` in sync_hosts.py."""
    classes = TRANSPORT_CLASSES | _subclasses_of_transports()
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == THE_ONE_PLACE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and _called_name(node) in classes:
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {_called_name(node)}(...)")
    assert not outside, "build these through moe_grpo/sync/transports.py:\n" + "\n".join(outside)


def test_the_scan_sees_a_transport_built_outside():
    """The scan itself: a call of a transport class by name or through its module is found."""
    source = "import moe_grpo.sync.transport as t\nx = SharedMemoryTransport('/r')\ny = t.CudaIpcTransport()\n"
    calls = [_called_name(n) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    assert {"SharedMemoryTransport", "CudaIpcTransport"} <= set(calls) & TRANSPORT_CLASSES
    assert "CudaIpcTransport" in _subclasses_of_transports()
