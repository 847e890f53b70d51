"""What the machine or the SLURM job says about its nodes: host names, GPUs and CPUs per node.

Pure functions of an environment mapping (and, for compressed node lists, `scontrol show hostnames` when it is
there), so the placement plan can be built and tested with fake environments. Nothing here starts anything.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

RunCommand = Callable[[Sequence[str]], str]
"""Runs a command and returns its stdout; raises (OSError, CalledProcessError, TimeoutExpired) when it fails."""


@dataclass(frozen=True)
class NodeFacts:
    """The nodes a run may use, as the environment describes them."""

    nodes: tuple[str, ...]
    """Host names, in SLURM's order (the first runs the driver and Ray's head)."""
    gpus_per_node: int | None
    """GPUs on each node; None when the environment does not say."""
    cpus_per_node: int | None
    """CPUs on each node (the smallest, where nodes differ); None when the environment does not say."""
    source: str
    """Where `nodes` came from, for the printed plan (`SLURM_JOB_NODELIST=gpu[01-04]`, `this host`)."""
    problems: tuple[str, ...] = ()
    """Contradictions in the environment (node counts that disagree, values that do not parse)."""


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list -> host names, as `scontrol show hostnames` prints them.

    `node[01-03,07],login1` -> node01 node02 node03 node07 login1; several bracket groups in one name expand as
    their product (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2); zero padding is kept. Raises ValueError naming the
    part that does not parse."""
    names: list[str] = []
    for item in _split_top_level(text.strip()):
        if not item:
            continue
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for piece in pieces:
            if piece.startswith("["):
                if not piece.endswith("]"):
                    raise ValueError(f"host list {text!r}: unclosed bracket in {item!r}")
                choices.append(_expand_range(piece[1:-1], text))
            elif "[" in piece or "]" in piece:
                raise ValueError(f"host list {text!r}: unbalanced brackets in {item!r}")
            else:
                choices.append([piece])
        names.extend("".join(parts) for parts in itertools.product(*choices))
    return names


def _split_top_level(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {text!r}: unclosed bracket")
    items.append(text[start:])
    return items


def _expand_range(body: str, text: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise ValueError(f"host list {text!r}: {part!r} is not a number or a range a-b")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"host list {text!r}: range {part!r} runs backwards")
        width = len(first) if first.startswith("0") or len(first) == len(last) else 0
        out.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return out


def run_command_stdout(argv: Sequence[str]) -> str:
    """`argv`'s stdout; raises when it cannot run, fails or takes more than 10 s."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=True).stdout


def hostnames(nodelist: str, run: RunCommand | None = run_command_stdout,
              scontrol: str = "scontrol") -> tuple[list[str], str]:
    """The host names of a SLURM node list and how they were expanded: `scontrol show hostnames` when it runs (it
    knows every syntax SLURM writes), the pure-Python expander otherwise (`run=None` skips scontrol)."""
    if run is not None and any(ch in nodelist for ch in "[,"):
        try:
            names = run([scontrol, "show", "hostnames", nodelist]).split()
            if names:
                return names, "scontrol show hostnames"
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_hostlist(nodelist), "expanded here"


def _int(environ: Mapping[str, str], key: str, problems: list[str]) -> int | None:
    value = environ.get(key, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        problems.append(f"{key}={value!r} is not an integer")
        return None


def gpus_from_slurm(environ: Mapping[str, str], problems: list[str]) -> int | None:
    """GPUs per node from SLURM's variables: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE ('8', 'h100:8',
    'a100:2,v100:1'), else SLURM_JOB_GPUS (the batch node's GPU indices); None when none is set."""
    on_node = _int(environ, "SLURM_GPUS_ON_NODE", problems)
    if on_node is not None:
        return on_node
    per_node = environ.get("SLURM_GPUS_PER_NODE", "").strip()
    if per_node:
        total = 0
        for part in per_node.split(","):
            count = part.rsplit(":", 1)[-1].split("(")[0]
            if not count.isdigit():
                problems.append(f"SLURM_GPUS_PER_NODE={per_node!r}: {part!r} names no GPU count")
                return None
            total += int(count)
        return total
    job_gpus = environ.get("SLURM_JOB_GPUS", "").strip()
    if job_gpus:
        return len([g for g in job_gpus.split(",") if g.strip()])
    return None


def cpus_from_slurm(environ: Mapping[str, str], problems: list[str]) -> int | None:
    """CPUs per node: the smallest count in SLURM_JOB_CPUS_PER_NODE ('64(x4)' or '72(x2),36'), else
    SLURM_CPUS_ON_NODE (this node's)."""
    per_node = environ.get("SLURM_JOB_CPUS_PER_NODE", "").strip()
    if per_node:
        counts = []
        for part in per_node.split(","):
            match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if not match:
                problems.append(f"SLURM_JOB_CPUS_PER_NODE={per_node!r}: {part!r} does not parse")
                break
            counts.append(int(match.group(1)))
        else:
            return min(counts)
    return _int(environ, "SLURM_CPUS_ON_NODE", problems)


def slurm_facts(environ: Mapping[str, str], run: RunCommand | None = run_command_stdout) -> NodeFacts | None:
    """The SLURM job's nodes (SLURM_JOB_NODELIST, checked against SLURM_NNODES / SLURM_JOB_NUM_NODES), GPUs and CPUs
    per node; None outside a SLURM job (no SLURM_JOB_NODELIST)."""
    nodelist = environ.get("SLURM_JOB_NODELIST", environ.get("SLURM_NODELIST", "")).strip()
    if not nodelist:
        return None
    problems: list[str] = []
    try:
        nodes, how = hostnames(nodelist, run, environ.get("SCONTROL", "scontrol"))
    except ValueError as e:
        return NodeFacts((), None, None, f"SLURM_JOB_NODELIST={nodelist}", (str(e),))
    for key in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        count = _int(environ, key, problems)
        if count is not None and count != len(nodes):
            problems.append(f"{key}={count} but SLURM_JOB_NODELIST={nodelist!r} names {len(nodes)} host(s) "
                            f"({how}): {' '.join(nodes)}")
            break
    return NodeFacts(tuple(nodes), gpus_from_slurm(environ, problems), cpus_from_slurm(environ, problems),
                     f"SLURM_JOB_NODELIST={nodelist} ({how})", tuple(problems))


def local_gpus(environ: Mapping[str, str], proc_gpus: str = "/proc/driver/nvidia/gpus") -> int | None:
    """GPUs this host offers without importing torch: CUDA_VISIBLE_DEVICES when set, else the NVIDIA driver's
    /proc entries; None when neither says (then nothing is checked against a GPU count)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip()]
        return 0 if ids and ids[0].strip().startswith("-") else len(ids)
    if os.path.isdir(proc_gpus):
        return len(os.listdir(proc_gpus))
    return None


def local_facts(environ: Mapping[str, str]) -> NodeFacts:
    """This host alone (the run starts a Ray cluster of its own here)."""
    return NodeFacts((socket.gethostname(),), local_gpus(environ), len(os.sched_getaffinity(0)), "this host")


SIGNAL_ENV = "MOE_GRPO_SIGNAL_S"
"""Seconds between SLURM's warning signal (`#SBATCH --signal=B:TERM@<seconds>`) and the job's time limit;
examples/slurm/train.sbatch exports it (from its own `--signal` line, or SBATCH_SIGNAL)."""


def signal_warning_s(environ: Mapping[str, str], problems: list[str]) -> float | None:
    """`MOE_GRPO_SIGNAL_S` as seconds; None when unset (a problem when it does not parse)."""
    value = environ.get(SIGNAL_ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        problems.append(f"{SIGNAL_ENV}={value!r}: expected the positive seconds of --signal's warning (e.g. 120 for "
                        "--signal=B:TERM@120)")
        return None
    return seconds
