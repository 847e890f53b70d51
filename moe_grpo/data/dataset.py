"""Rows of a local dataset (JSON Lines, a JSON array, CSV with a header, or Parquet; one file or a glob of a split's
shards): good rows kept, bad rows skipped, counted and named.

A bad row is a line that is not a JSON object, or a row whose required field
is missing or empty (None, "", whitespace, an empty list). A field is named by
its key or by a dotted path into nested objects (`reward_model.ground_truth`). It never stops the
run: it is skipped, counted (`data/bad_rows` in the run record) and reported
with its line (JSONL) or row number (Parquet, counting from 1). A file that
cannot be read at all, or that has no good row, is an error that names it.
"""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

log = logging.getLogger("moe_grpo")

MAX_LOGGED = 20
"""Bad rows reported one by one per file; the rest are summed up in one line."""


@dataclass(frozen=True)
class BadRow:
    path: str
    line: int
    """Line number (JSONL) or row number (Parquet), from 1."""
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class Rows:
    """The good rows of a dataset (one file, or the files a glob names, in name order) with their places, and the
    bad ones."""

    path: str
    """The dataset as configured: a file, or a glob of files (a split's shards)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    """The file each row came from (empty: `path` for every row)."""

    def place(self, i: int) -> tuple[str, int]:
        """(file, line) of row `i`."""
        return (self.files[i] if self.files else self.path), self.lines[i]


def _empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, tuple, dict)):
        return len(value) == 0
    return False


MISSING = object()
"""What `field_value` gives for a field a row does not have."""


def field_value(row: dict[str, Any], key: str) -> Any:
    """The row's `key`: the field of that name, else a dotted path into nested objects (verl's datasets keep the
    answer in `reward_model.ground_truth`); `MISSING` when neither is there."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def _records(path: Path) -> Any:
    """(line, record or an error message) in file order."""
    suffix = path.suffix.lower()
    if suffix != ".parquet" and _starts_with(path, "["):  # one JSON array of objects, whatever its name says
        try:                                                # (`.json` is JSON Lines too: datasets' `to_json`)
            records = json.loads(path.read_text(encoding="utf-8-sig", errors="replace"))
        except json.JSONDecodeError:
            records = None  # JSON Lines whose first row is an array: read line by line below
        if isinstance(records, list):
            yield from ((i, _object_or_reason(r)) for i, r in enumerate(records, start=1))  # numbered as Parquet's
            return
    if suffix == ".csv":  # a header line, then a row per line: each row numbered by its line in the file
        import pyarrow.csv as pcsv

        try:
            table = pcsv.read_csv(str(path))
        except Exception as e:  # noqa: BLE001 - the whole file is unreadable: not a row's fault
            raise ValueError(f"{path}: not a readable CSV file ({type(e).__name__}: {e})") from e
        yield from enumerate(table.to_pylist(), start=2)
        return
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - pyarrow is a dependency
            raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from e
        try:
            table = pq.read_table(str(path))
        except Exception as e:  # noqa: BLE001 - the whole file is unreadable: not a row's fault
            raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from e
        # maps as dicts: chat messages stored as map<string, string> read as messages, not lists of pairs
        for i, row in enumerate(table.to_pylist(maps_as_pydicts="lossy"), start=1):
            yield i, row
        return
    # utf-8-sig: a file saved with a byte-order mark (Windows editors) keeps its first row.
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:  # without its line end: an error at the end of the line is reported at its column, not at 1
                yield i, _object_or_reason(json.loads(line.rstrip("\r\n")))
            except json.JSONDecodeError as e:
                yield i, f"not valid JSON ({e.msg} at column {e.colno})"


def _object_or_reason(record: Any) -> Any:
    """A JSON row, or why it is none: a string here is a reason (a JSON string row must not read as one)."""
    return record if isinstance(record, dict) else f"expected a JSON object, got {type(record).__name__}"


def _starts_with(path: Path, char: str) -> bool:
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        while block := f.read(4096):
            if block.strip():
                return block.lstrip().startswith(char)
    return False


def dataset_files(path: str | Path) -> list[Path]:
    """The files of a dataset: the file itself, or those a glob names (`train-*.parquet`, the shards of one split
    as a Hugging Face hub download leaves them), in name order."""
    text = str(path)
    if any(c in text for c in "*?[") and not Path(path).is_file():  # a file named data[1].jsonl is that file
        files = sorted(Path(f) for f in glob.glob(text) if Path(f).is_file())
        if not files:
            raise FileNotFoundError(f"dataset {path}: no file matches")
        return files
    p = Path(path)
    if p.is_dir():
        raise FileNotFoundError(f"dataset {path} is a directory: name its files, e.g. '{p / 'train-*.parquet'}' (a "
                                "glob of one split's shards)")
    if not p.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    return [p]


def log_skipped(bad: Sequence[BadRow], what: str, path: str | Path) -> None:
    """Log the first `MAX_LOGGED` skipped rows of `path` with their lines, then how many more (`what`) there are."""
    for row in bad[:MAX_LOGGED]:
        log.warning("data: skipped %s", row)
    if len(bad) > MAX_LOGGED:
        log.warning("data: ... and %d more %s in %s", len(bad) - MAX_LOGGED, what, path)


class NoUsableRows(ValueError):
    """A dataset none of whose rows can be used; `bad` holds them all, with their reasons."""

    def __init__(self, bad: list[BadRow], message: str) -> None:
        super().__init__(message)
        self.bad = bad


def read_rows(path: str | Path, required: Sequence[str],
              check: Callable[[dict[str, Any]], str | None] | None = None, why: str | None = None) -> Rows:
    """Every row of `path` that is an object with each `required` field present and non-empty.

    `check(row)` may refuse a row with a reason (e.g. a GSM8K answer without `#### N`). `why`: what needs the
    fields beyond the first, said when no row has them."""
    files = dataset_files(path)
    out = Rows(str(path))
    for file, line, record in ((f, line, record) for f in files for line, record in _records(f)):
        reason = None
        if isinstance(record, str):
            reason = record
        elif not isinstance(record, dict):
            reason = f"expected a JSON object, got {type(record).__name__}"
        else:
            values = {k: field_value(record, k) for k in required}
            missing = [k for k, v in values.items() if v is MISSING]
            empty = [k for k, v in values.items() if v is not MISSING and _empty(v)]
            if missing:
                reason = f"missing field(s) {missing}"
            elif empty:
                reason = f"empty field(s) {empty}"
            elif check is not None:
                reason = check(record)
        if reason is None:
            out.rows.append(record)
            out.lines.append(line)
            out.files.append(str(file))
        else:
            out.bad.append(BadRow(str(file), line, reason))
    log_skipped(out.bad, "bad rows", path)
    if not out.rows:
        raise NoUsableRows(out.bad, f"dataset {path} has no usable row ({len(out.bad)} bad; first: "
                         f"{out.bad[0] if out.bad else 'the file is empty'})" + (f"; {why}" if why and any(
                             repr(k) in b.reason for b in out.bad for k in required[1:]) else ""))
    return out
