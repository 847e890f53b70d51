"""The run record's `sync/*` keys from learner ranks whose background publishes finished at different times
(sync_metrics.newest_common_version, then combine_sync_metrics: pure logic, no ranks started).

Would have caught (a whole-suite run, 2026-11-27, test_lora_runs[deepseek_v3-TP=2-keep-serve]): the first row's
`sync/bytes` read 282,896, neither an adapter version (13,824) nor the first whole version (549,184): the driver
added rank 0's report of the whole first version to rank 1's report of the next, adapter-only one, whose
background publish had finished sooner."""

from __future__ import annotations

from moe_grpo.sync.sync_metrics import combine_sync_metrics, newest_common_version


def _report(version: int, sent: float, seconds: float = 0.1) -> dict[str, float]:
    return {"sync/seconds": seconds, "sync/bytes": sent, "sync/full_bytes": sent,
            "sync/delta": 0.0}


def test_a_row_adds_up_the_ranks_reports_of_one_version_only():
    # the first version (base + adapter, 549,184 bytes over two TP ranks), then an adapter version (13,824)
    rank0 = {0: _report(0, 275_984.0)}  # its publish of version 1 still running
    rank1 = {0: _report(0, 273_200.0), 1: _report(1, 6_912.0)}
    row = combine_sync_metrics(newest_common_version([rank0, rank1]))
    assert row["sync/bytes"] == 549_184.0
    rank0[1] = _report(1, 6_912.0, seconds=0.3)
    row = combine_sync_metrics(newest_common_version([rank0, rank1]))
    assert row["sync/bytes"] == 13_824.0 and row["sync/seconds"] == 0.3


def test_before_every_rank_finished_a_version_a_row_reports_nothing_sent():
    row = combine_sync_metrics(newest_common_version([{}, {0: _report(0, 273_200.0)}]))
    assert row["sync/bytes"] == 0.0 and row["sync/delta"] == 0.0
