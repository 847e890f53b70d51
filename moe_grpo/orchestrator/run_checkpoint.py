"""Run checkpoints on disk: written whole or not at all, verified before they are trusted.

    <run dir>/checkpoints/
        step_000010/            one complete checkpoint
            learner/            every learner rank's state (Megatron distributed checkpoint: any layout reloads it)
            driver.pkl          the driver's state: run state, buffer (completions, versions, routing traces),
                                prompt source, requests in flight, jump watch, the driver's RNGs
            manifest.json       every file above with its size and sha256; written last
        latest                  "step_000010", replaced atomically after the directory is in place

A checkpoint is written into `step_N.tmp` and renamed into place, then `latest`
is moved, then checkpoints beyond `checkpoint.keep` are deleted: a crash at any
point leaves the previous checkpoint whole and `latest` pointing at a complete one.
Every file and directory is fsynced before the rename, and the rename before
`latest` moves, so a power loss cannot leave `latest` naming a checkpoint whose
data never reached the disk. Every file's sha256 is in the manifest and checked
on load, whatever its size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from moe_grpo.hashing import HashingWriter
from moe_grpo.learner.megatron_write_digests import DIGEST_SUFFIX, Digest, read_digest

log = logging.getLogger("moe_grpo")

MANIFEST = "manifest.json"
DRIVER_STATE = "driver.pkl"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; names the file."""


class ResumeRefused(CheckpointError, ValueError):
    """`resume=true` cannot continue this run as configured (no checkpoint verifies where steps were recorded, or
    the config changes what the checkpoint means); raised before anything starts, and reported in one line."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def begin(run_dir: str | Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of `step` (left-overs of a crashed write are removed)."""
    tmp = checkpoints_dir(run_dir) / (step_name(step) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "learner").mkdir()
    return tmp


@contextlib.contextmanager
def writing(run_dir: str | Path, step: int) -> Iterator[Path]:
    """`begin`'s directory for the checkpoint of `step`, removed if the write fails: on a full disk the partial
    checkpoint stayed and held the room (a user's trial, 2026-11-28); a resume never reads a `.tmp`."""
    tmp = begin(run_dir, step)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(path: Path, *, fsync: bool = False) -> str:
    """The file's sha256; `fsync`: also flush it to the disk (one open for both)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Files hashed at once when a checkpoint is written or verified."""


def _sha256_all(paths: list[Path], *, fsync: bool = False) -> list[str]:
    """`_sha256` of each path, several files at a time (hashlib lets go of the GIL while it hashes): a real model's
    checkpoint is many shard files, hashed at about 0.8 GB/s per core."""
    if len(paths) < 2:
        return [_sha256(p, fsync=fsync) for p in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), HASH_THREADS)) as pool:
        return list(pool.map(lambda p: _sha256(p, fsync=fsync), paths))


def _take_write_digests(tmp: Path) -> dict[Path, Digest]:
    """The digests Megatron's writer left beside the shards it wrote under `tmp` (whose size still matches),
    by shard; every digest file is removed, so the checkpoint holds only what was saved."""
    taken = {}
    for digest_file in sorted(tmp.rglob("*" + DIGEST_SUFFIX)):
        shard = digest_file.with_name(digest_file.name[: -len(DIGEST_SUFFIX)])
        digest = read_digest(digest_file)
        digest_file.unlink()
        if digest is not None and shard.is_file() and shard.stat().st_size == digest.size:
            taken[shard] = digest
        else:
            log.warning("checkpoint: %s does not describe %s; hashing the file instead", digest_file, shard)
    return taken


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finish(tmp: Path, driver_state: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    """Write the driver's state and the manifest into `tmp`, make everything in it durable, rename it into place,
    move `latest`, prune.

    The driver's state is hashed as it is pickled. The learner ranks' shard files were hashed as Megatron's writer
    wrote them (learner/megatron_write_digests.py): their digests are taken from the digest files left beside them
    (which are removed) and the shards are only fsynced, never read. Any other file, or a shard whose digest file
    is missing or names another size, is hashed here in the same pass that fsyncs it."""
    with open(tmp / DRIVER_STATE, "wb") as f:
        writer = HashingWriter(f)
        pickle.dump(driver_state, writer, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    files = {DRIVER_STATE: {"size": writer.size, "sha256": writer.hash.hexdigest()}}
    written = _take_write_digests(tmp)
    others = [p for p in sorted(tmp.rglob("*")) if p.is_file() and str(p.relative_to(tmp)) not in files]
    for path in others:
        if path in written:
            _fsync_file(path)
            files[str(path.relative_to(tmp))] = {"size": written[path].size, "sha256": written[path].sha256}
    unhashed = [p for p in others if p not in written]
    for path, digest in zip(unhashed, _sha256_all(unhashed, fsync=True)):
        files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "sha256": digest}
    _write_atomic(tmp / MANIFEST, json.dumps({**meta, "files": files}, indent=1, sort_keys=True))
    for directory in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(directory)
    _fsync_dir(tmp)
    final = tmp.with_name(tmp.name[: -len(".tmp")])
    old = final.with_name(final.name + ".old")
    if final.exists():  # the same step checkpointed again (a signal right after a periodic checkpoint)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)  # the rename is on disk before `latest` names it
    shutil.rmtree(old, ignore_errors=True)
    _write_atomic(final.parent / "latest", final.name)
    _prune(final.parent, keep)
    return final


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith((".tmp", ".old")))
    for path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def verify(path: str | Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError naming the first file that is missing or damaged."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing; the checkpoint {path} was not finished")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable ({e}); the checkpoint {path} is damaged") from e
    hashed = []
    for rel, want in manifest.get("files", {}).items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from checkpoint {path}")
        size = file.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {want['size']}; the checkpoint is "
                                  "truncated or damaged")
        if "sha256" in want:  # (checkpoints written before 2026-11-26 left files over 256 MiB without one)
            hashed.append((file, want["sha256"]))
    for (file, want), got in zip(hashed, _sha256_all([f for f, _ in hashed])):
        if got != want:
            raise CheckpointError(f"{file}: content differs from the manifest's sha256; the checkpoint is corrupt")
    return manifest


def load_driver_state(path: str | Path) -> dict[str, Any]:
    """The driver's state of a verified checkpoint."""
    file = Path(path) / DRIVER_STATE
    try:
        with open(file, "rb") as f:
            return pickle.load(f)  # noqa: S301 - the run's own file, checked against its manifest
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{file}: cannot be read ({type(e).__name__}: {e})") from e


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories of a run, newest first (what `latest` names first, then by step)."""
    root = checkpoints_dir(run_dir)
    found = sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith((".tmp", ".old"))),
                   reverse=True)
    latest = root / "latest"
    if latest.is_file():
        named = root / latest.read_text().strip()
        found = [named] + [p for p in found if p != named] if named.is_dir() else found
    return found


def newest_valid(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies (a damaged newer one is reported by name and skipped), or None."""
    return _newest_valid(run_dir)[0]


def _newest_valid(run_dir: str | Path) -> tuple[tuple[Path, dict[str, Any]] | None, list[str]]:
    """(the newest checkpoint that verifies or None, why each newer one was refused)."""
    refused = []
    for path in complete_checkpoints(run_dir):
        try:
            return (path, verify(path)), refused
        except CheckpointError as e:
            log.error("resume: %s; falling back to the previous checkpoint", e)
            refused.append(f"{path.name}: {e}")
    return None, refused


def rollback_target(run_dir: str | Path, jump_began: int) -> Path | None:
    """The checkpoint the collapse guard restores for a jump first seen at step `jump_began`: the newest one that
    verifies, of a step before `jump_began`, and not written inside a jump window (its manifest's `jump_in_a_row`
    is 0). The guard acts only once a jump has lasted `routing.jump_sustain` steps, so checkpoints of the jump's
    first steps are on disk by then: they hold weights trained on the jumped batches, and restoring one would spend
    a rollback on the jump itself. None where no checkpoint qualifies."""
    for path in sorted(complete_checkpoints(run_dir), key=lambda p: p.name, reverse=True):  # by step, not `latest`
        try:
            manifest = verify(path)
        except CheckpointError as e:
            log.error("collapse guard: %s; not restored", e)
            continue
        if int(manifest.get("step", jump_began)) < jump_began and not manifest.get("jump_in_a_row", 0):
            return path
    return None


RECORD = "metrics.jsonl"
"""The run record (run_record.py): one line per step a run took."""


def recorded_steps(run_dir: str | Path) -> int:
    """Lines in the run's record: steps an earlier process took here (0 without a record)."""
    try:
        with open(Path(run_dir) / RECORD, "rb") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def resume_point(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """Where `resume=true` continues: the newest checkpoint that verifies (newer damaged ones named in the log).

    None where the directory holds neither a checkpoint nor a recorded step: a requeued job's first start, which
    starts from the beginning. Where an earlier process recorded steps or left checkpoints and none verifies,
    starting over would record those steps a second time after the old ones: CheckpointError naming each
    checkpoint and why it was refused (or that none was written)."""
    found, refused = _newest_valid(run_dir)
    if found is not None:
        return found
    root = checkpoints_dir(run_dir)
    unfinished = sorted(p.name for p in root.glob("step_*.tmp") if p.is_dir())
    refused += [f"{name}: its write did not finish" for name in unfinished]
    steps = recorded_steps(run_dir)
    if not refused and not steps:
        return None
    record = f"{Path(run_dir) / RECORD} records {steps} step(s)" if steps else f"{root} holds checkpoints"
    why = ("; ".join(refused) if refused else
           f"no checkpoint is in {root}: the earlier run ended before its first (written at step checkpoint.every, "
           "on SIGTERM, SIGUSR1 or a first Ctrl-C, and at the end unless checkpoint.at_end=false)")
    raise ResumeRefused(f"resume=true: {record} of an earlier run, but no checkpoint to continue from verifies: "
                          f"{why}. Starting from step 0 would record those steps again; start a new run in another "
                          "directory (or remove the record and checkpoints/ to start this one over)")
