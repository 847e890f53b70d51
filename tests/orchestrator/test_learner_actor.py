"""What a learner rank's process leaves behind when it is killed (pure process logic: no Ray, no model)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from moe_grpo.processes import process_alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow  # starts a learner rank's process tree

FORKS_THEN_WAITS = """
import os, sys, time
sys.path.insert(0, {root!r})
if {hook}:
    from moe_grpo.orchestrator.learner_actor import children_die_with_their_parent
    children_die_with_their_parent()
pid = os.fork()
if pid == 0:  # what megatron-core's checkpoint writer does: a forked child that waits on its queue
    if os.fork() == 0:  # and its own child
        time.sleep(120)
        os._exit(0)
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
time.sleep(120)
"""


def _children_after_parent_killed(hook: bool) -> list[int]:
    proc = subprocess.Popen([sys.executable, "-c", FORKS_THEN_WAITS.format(root=ROOT, hook=hook)],
                            stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    deadline = time.monotonic() + 30
    grandchildren = []
    while not grandchildren and time.monotonic() < deadline:  # until the grandchild is forked (slow when loaded)
        time.sleep(0.05)
        grandchildren = [int(p) for p in open(f"/proc/{child}/task/{child}/children").read().split()]
    assert grandchildren, "the child did not fork within 30 s"
    os.kill(proc.pid, signal.SIGKILL)  # the rank dies mid-write
    proc.wait()
    deadline = time.monotonic() + 5
    alive = [child] + grandchildren
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if process_alive(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    return alive


def test_processes_a_rank_forked_die_with_it_and_without_the_hook_they_would_be_orphaned():
    assert _children_after_parent_killed(hook=True) == [], "forked children (and theirs) outlived the rank"
    assert len(_children_after_parent_killed(hook=False)) == 2, "the check must see orphans where they happen"
