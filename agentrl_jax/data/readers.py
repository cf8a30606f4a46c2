"""Read JSONL / JSON / Parquet files into validated records, counting every bad row.

A bad row (unparsable JSON line, missing field, wrong type, empty prompt, ...) is
skipped, counted per reason in `DataStats`, and logged: the first few verbatim with
`file:line`, then a summary. It never crashes the run. A file in which no row is good
is an error (`DataError`): that is a wrong path or a wrong format, not noise.

Locations are `path:N` with N the 1-based line (JSONL), list position (JSON) or row
(Parquet).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from agentrl_jax.data.records import BadRowError

logger = logging.getLogger(__name__)

Record = TypeVar("Record")
RowParser = Callable[[Mapping[str, Any], str], Record]

SUFFIXES = (".jsonl", ".json", ".parquet")
_SNIPPET_CHARS = 300


class DataError(ValueError):
    """A dataset that cannot be used at all (missing file, no good rows)."""


@dataclasses.dataclass
class DataStats:
    """Counts of rows read, kept and skipped, per skip reason.

    Attributes:
      rows_read: rows seen (blank JSONL lines are not rows).
      rows_kept: rows that became records.
      bad_by_reason: skipped rows per reason, e.g. {"missing_field:prompt": 3}.
      duplicates: good rows dropped as repeats of an earlier record (only with deduplication).
      examples: "file:line: error" for the first `max_examples` bad rows.
      max_examples: how many bad rows are logged verbatim.
    """

    rows_read: int = 0
    rows_kept: int = 0
    bad_by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    duplicates: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)
    max_examples: int = 5

    @property
    def rows_bad(self) -> int:
        return sum(self.bad_by_reason.values())

    def record_bad(self, location: str, reason: str, message: str, raw: str) -> None:
        """Counts one skipped row; logs it verbatim while under `max_examples`."""
        self.rows_read += 1
        self.bad_by_reason[reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{location}: {message}")
            logger.warning("%s: skipped bad row (%s): %s", location, message, raw[:_SNIPPET_CHARS])

    def record_good(self) -> None:
        self.rows_read += 1
        self.rows_kept += 1

    def merge(self, other: DataStats) -> None:
        """Adds `other`'s counts into this one (used to total over files)."""
        self.rows_read += other.rows_read
        self.rows_kept += other.rows_kept
        self.duplicates += other.duplicates
        self.bad_by_reason.update(other.bad_by_reason)
        room = self.max_examples - len(self.examples)
        self.examples.extend(other.examples[: max(room, 0)])

    def summary(self) -> str:
        """One line: kept/read and the skip reasons."""
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.bad_by_reason.items()))
        text = f"kept {self.rows_kept}/{self.rows_read} rows; skipped {self.rows_bad}" + (
            f" ({reasons})" if reasons else "")
        return text + (f"; dropped {self.duplicates} duplicates" if self.duplicates else "")

    def as_metrics(self, prefix: str = "data/") -> dict[str, int]:
        """Counts as a flat metrics dict for the metrics writer."""
        metrics = {f"{prefix}rows_read": self.rows_read, f"{prefix}rows_kept": self.rows_kept,
                   f"{prefix}rows_bad": self.rows_bad, f"{prefix}duplicates": self.duplicates}
        metrics.update({f"{prefix}bad/{k}": v for k, v in self.bad_by_reason.items()})
        return metrics


def resolve_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Expands files, directories (their .jsonl/.json/.parquet files) and globs, sorted.

    Raises:
      DataError: a path that matches nothing, or a file with an unknown suffix.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    resolved: list[str] = []
    for path in map(os.fspath, paths):
        if os.path.isdir(path):
            found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(SUFFIXES))
        elif any(ch in path for ch in "*?["):
            found = sorted(glob.glob(path))
        else:
            found = [path] if os.path.exists(path) else []
        if not found:
            raise DataError(f"data path {path!r} matches no file (expected {', '.join(SUFFIXES)})")
        for name in found:
            if not name.endswith(SUFFIXES):
                raise DataError(f"{name}: unknown data file type; use one of {', '.join(SUFFIXES)}")
        resolved.extend(found)
    return resolved


def iter_raw_rows(path: str) -> Iterator[tuple[str, Any, str | None]]:
    """Yields `(location, row, parse_error)` for each row of one file.

    `row` is the decoded object (None when the line is not valid JSON, in which case
    `parse_error` says why and the raw line is in `row`'s place as a string).
    """
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{line_no}", json.loads(line), None
                except json.JSONDecodeError as e:
                    yield f"{path}:{line_no}", line.rstrip("\n"), f"unparsable JSON ({e.msg} at column {e.colno})"
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON ({e}); a .json file must hold a list of rows") from e
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json data file must hold a list of rows, got {type(data).__name__}")
        for i, row in enumerate(data, start=1):
            yield f"{path}:{i}", row, None
    else:
        import pyarrow.parquet as pq  # imported lazily: only Parquet users pay for it

        row_no = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                row_no += 1
                yield f"{path}:{row_no}", row, None


def _raw_text(row: Any) -> str:
    if isinstance(row, str):
        return row
    try:
        return json.dumps(row, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(row)


def read_file_records(path: str, parse_row: RowParser, max_examples: int = 5,
                      seen: set | None = None) -> tuple[list, DataStats]:
    """Reads one file; returns its records and stats.

    Args:
      path: a .jsonl, .json or .parquet file.
      parse_row: `(row, default_id) -> record`, raising `BadRowError` for a bad row.
      max_examples: bad rows logged verbatim.
      seen: when given, deduplicate: records whose `dedup_key` is in `seen` are dropped
        and counted in `stats.duplicates`; new keys are added to it.

    Raises:
      DataError: when the file holds no good row.
    """
    stats = DataStats(max_examples=max_examples)
    records = []
    base = os.path.basename(path)
    for location, row, parse_error in iter_raw_rows(path):
        if parse_error is not None:
            stats.record_bad(location, "unparsable_json", parse_error, _raw_text(row))
            continue
        if not isinstance(row, Mapping):
            stats.record_bad(location, "wrong_type:<row>", f"expected an object, got {type(row).__name__}",
                             _raw_text(row))
            continue
        try:
            record = parse_row(row, f"{base}:{location.rsplit(':', 1)[1]}")
        except BadRowError as e:
            stats.record_bad(location, e.reason, str(e), _raw_text(row))
            continue
        stats.record_good()
        if seen is not None:
            key = dedup_key(record)
            if key in seen:
                stats.rows_kept -= 1
                stats.duplicates += 1
                continue
            seen.add(key)
        records.append(record)
    if not records and not stats.duplicates:
        first = "; ".join(stats.examples[:3]) or "the file is empty"
        raise DataError(f"{path}: no usable rows out of {stats.rows_read} ({stats.summary()}). First errors: {first}")
    return records, stats


def dedup_key(record: Any) -> Any:
    """What makes two records the same: the conversation, or (prompt, answer); ids are ignored."""
    messages = getattr(record, "messages", None)
    return messages if messages is not None else (record.prompt, record.answer)


def read_records(paths: str | os.PathLike | Sequence[str | os.PathLike], parse_row: RowParser,
                 max_examples: int = 5, deduplicate: bool = False) -> tuple[list, DataStats]:
    """Reads every file in `paths` (see `resolve_paths`), in sorted order per entry.

    With `deduplicate`, a record equal (`dedup_key`) to an earlier one, in any file, is
    dropped and counted in `stats.duplicates` (DAPO-Math-17k's parquet repeats each of
    its ~17k problems many times).

    Returns:
      (records in file order, totals over all files). Bad rows are logged and counted;
      a summary line is logged when any row was skipped.

    Raises:
      DataError: a path matching nothing, or a file with no good row.
    """
    total = DataStats(max_examples=max_examples)
    records: list = []
    seen: set | None = set() if deduplicate else None
    for path in resolve_paths(paths):
        file_records, stats = read_file_records(path, parse_row, max_examples=max_examples, seen=seen)
        records.extend(file_records)
        total.merge(stats)
        if stats.rows_bad:
            logger.warning("%s: %s", path, stats.summary())
        elif stats.duplicates:
            logger.info("%s: %s", path, stats.summary())
    return records, total
