import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moe_grpo.routing.metrics import agreement, expert_load
from moe_grpo.routing.trace import RoutingTrace, RoutingTraceError, load_traces, save_traces


def trace(rows):
    return RoutingTrace.from_array(np.array(rows), 4)


def test_expert_load_counts_assignments_per_layer():
    t = trace([[[0, 1], [2, 3]], [[0, 2], [2, 3]]])
    load = expert_load([t])
    np.testing.assert_allclose(load[0], [0.5, 0.25, 0.25, 0.0])
    np.testing.assert_allclose(load[1], [0.0, 0.0, 0.5, 0.5])


def test_agreement_compares_sets_not_order():
    a = trace([[[0, 1], [2, 3]], [[0, 2], [2, 3]]])
    b = trace([[[1, 0], [2, 3]], [[0, 3], [2, 3]]])
    r = agreement([a], [b])
    assert r["set_agreement_per_layer"] == [0.5, 1.0]
    assert r["set_agreement"] == 0.75
    assert r["overlap"] == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    with pytest.raises(RoutingTraceError, match="shapes"):
        agreement([a], [trace([[[0, 1], [2, 3]]])])


def test_trace_files_round_trip_and_the_inspect_tool_reads_them(tmp_path):
    a = trace([[[0, 1], [2, 3]], [[0, 2], [2, 3]]])
    b = trace([[[1, 0], [2, 3]], [[0, 3], [2, 3]]])
    save_traces(str(tmp_path / "a.npz"), [a, a])
    save_traces(str(tmp_path / "b.npz"), [b, b])
    back = load_traces(str(tmp_path / "a.npz"))
    assert len(back) == 2 and np.array_equal(back[1].expert_ids, a.expert_ids)
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "inspect_trace.py")
    out = subprocess.run([sys.executable, tool, str(tmp_path / "a.npz"), "--against",
                          str(tmp_path / "b.npz")], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["set_agreement"] == 0.75 and report["sequences"] == 2
    with pytest.raises(RoutingTraceError, match="not a routing-trace file"):
        (tmp_path / "bad.npz").write_text("nope")
        load_traces(str(tmp_path / "bad.npz"))
