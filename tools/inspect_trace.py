"""Inspect routing traces: per-layer expert load, and agreement with another trace of the same tokens.

    python tools/inspect_trace.py traces.npz                    # load per MoE layer
    python tools/inspect_trace.py rollout.npz --against learner.npz

Trace files hold one [positions, moe_layers, topk] array per sequence
(`moe_grpo.routing.trace.save_traces`). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", help=".npz file written by save_traces")
    ap.add_argument("--against", help="a second trace file of the same sequences")
    ap.add_argument("--top", type=int, default=3, help="most-loaded experts to list per layer")
    args = ap.parse_args(argv)

    import numpy as np

    from moe_grpo.routing.metrics import agreement, expert_load
    from moe_grpo.routing.trace import load_traces

    traces = load_traces(args.traces)
    load = expert_load(traces)
    uniform = 1.0 / load.shape[1]
    print(f"{len(traces)} sequences, {sum(t.num_positions for t in traces)} positions, "
          f"{load.shape[0]} MoE layers, {load.shape[1]} experts, top-{traces[0].top_k}, "
          f"{traces[0].bytes_per_token} bytes/token")
    for layer, row in enumerate(load):
        top = np.argsort(-row)[: args.top]
        busiest = ", ".join(f"e{e}={row[e]:.3f}" for e in top)
        print(f"  layer {layer}: max/uniform {row.max() / uniform:.2f}, unused experts {int((row == 0).sum())}, busiest {busiest}")
    report: dict[str, object] = {"sequences": len(traces), "max_over_uniform_per_layer": (load.max(1) / uniform).round(3).tolist()}
    if args.against:
        other = load_traces(args.against)
        agree = agreement(traces, other)
        print(f"agreement with {args.against}: top-k set equal on {agree['set_agreement']:.4f} of (token, layer), "
              f"mean expert overlap {agree['overlap']:.4f}")
        report.update(agree)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
