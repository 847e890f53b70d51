"""How long a run checkpoint of the model takes to write, against SLURM's warning before the time limit.

SLURM signals the job `--signal`'s seconds before the time limit (examples/slurm/train.sbatch: 120 s); the driver
then finishes the current step and writes a checkpoint. A checkpoint holds the weights (`megatron.params_dtype`) and
Adam's state (fp32 main parameters when the weights are not fp32, and two fp32 moments): for Qwen3-30B-A3B in bf16,
30.5B x 14 bytes = 427 GB. At the rate one process writes where the run directory is (measured: a file written and
fsynced), that is the time a checkpoint takes when the file system does not scale with the ranks writing at once (an
upper bound when it does). The plan prints it beside the warning time and warns when it does not fit.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

from moe_grpo.orchestrator.memory_estimate import DTYPE_BYTES

PROBE_BYTES = 256 << 20
"""What `measure_write_gbps` writes: enough to get past the page cache's first burst, little enough to take a
second or so on a slow shared file system."""
CHUNK = 8 << 20


def checkpoint_bytes(total_params: int, params_dtype: str) -> tuple[int, int]:
    """(weights, optimizer) bytes of a run checkpoint of the whole model."""
    wbytes = DTYPE_BYTES[params_dtype]
    return total_params * wbytes, total_params * (8 if wbytes == 4 else 12)


def measure_write_gbps(directory: str, nbytes: int = PROBE_BYTES) -> float:
    """GB/s (1e9 bytes) at which this process writes and fsyncs `nbytes` into a temporary file in `directory`
    (removed afterwards)."""
    block = os.urandom(CHUNK)  # incompressible, as weights are
    fd, path = tempfile.mkstemp(prefix=".moe_grpo-write-rate-", dir=directory)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, block[:min(CHUNK, nbytes - written)])
        os.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return written / max(seconds, 1e-9) / 1e9


@dataclass(frozen=True)
class CheckpointTime:
    """A checkpoint's size and write time against the warning time of SLURM's signal."""

    weights: int
    optimizer: int
    gbps: float | None
    """Measured write rate; None when not measured."""
    where: str | None
    """Where the rate was measured; None: given, not measured."""
    signal_s: float | None
    """Seconds from SLURM's warning signal to the time limit; None when not known."""

    @property
    def total(self) -> int:
        return self.weights + self.optimizer

    @property
    def seconds(self) -> float | None:
        return self.total / (self.gbps * 1e9) if self.gbps else None

    @property
    def fits(self) -> bool | None:
        """Whether the write fits the warning time (None when either is unknown)."""
        if self.seconds is None or self.signal_s is None:
            return None
        return self.seconds < self.signal_s

    def line(self) -> str:
        size = (f"checkpoint: {_gb(self.total)} (weights {_gb(self.weights)} + Adam {_gb(self.optimizer)}, the whole "
                "model)")
        if self.seconds is None:
            return size + ("; write time not measured" + (f" (SLURM's warning comes {self.signal_s:g} s before the "
                                                         "time limit)" if self.signal_s else
                                                         " (MOE_GRPO_SIGNAL_S unset: --signal's time unknown)"))
        how = f"one writer, measured in {self.where}" if self.where else "given"
        text = f"{size} ~ {_duration(self.seconds)} at {self.gbps:.2f} GB/s ({how})"
        if self.signal_s is None:
            return text + "; --signal's warning time unknown (MOE_GRPO_SIGNAL_S unset): not checked"
        verdict = (f"fits, {self.signal_s - self.seconds:.0f} s left for the step running when it comes" if self.fits
                   else "DOES NOT FIT")
        return f"{text}; SLURM's warning comes {self.signal_s:g} s before the time limit (--signal): {verdict}"

    def warning(self) -> str | None:
        """What the plan says when the checkpoint does not fit the warning time."""
        if self.fits is not False:
            return None
        assert self.seconds is not None and self.signal_s is not None
        need = int(-(-(self.seconds * 1.5 + 60) // 60) * 60)  # a margin for the step still running, whole minutes
        return (f"a checkpoint of this model ({_gb(self.total)}) takes ~{_duration(self.seconds)} at "
                f"{self.gbps:.2f} GB/s, longer than the {self.signal_s:g} s between SLURM's warning signal and the "
                "time limit (plus the rest of the step running when it comes): the job would be killed mid-write "
                f"and resume from the checkpoint before. Give it more time (e.g. #SBATCH --signal=B:TERM@{need}, "
                "and MOE_GRPO_SIGNAL_S when set by hand), a faster file system for the run directory, or "
                "checkpoint.every to lose fewer steps")


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.0f} min"
