"""Read JSONL / JSON / Parquet files into validated records, counting every bad row.

A bad row (unparsable JSON line, missing field, wrong type, empty prompt, keys that
differ only in case, ...) is skipped, counted per reason in `DataStats`, and logged: the
first few verbatim with `file:line`, then a summary. It never crashes the run. A file in
which no row is valid is an error (`DataError`): that is a wrong path or a wrong format,
not noise; so is a Parquet file with two columns that differ only in case. Repeated
rows are dropped and counted too (deduplication, on by default: see `dedup.py`).

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
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from agentrl_jax.data.dedup import DUPLICATE, Deduplicator
from agentrl_jax.data.records import BadRowError, check_keys

logger = logging.getLogger(__name__)

Record = TypeVar("Record")
RowParser = Callable[[Mapping[str, Any], str], Record]

SUFFIXES = (".jsonl", ".json", ".parquet")
_SNIPPET_CHARS = 300
_ILLEGAL_METRIC_CHARS = re.compile(r"[^A-Za-z0-9_/.-]+")


class DataError(ValueError):
    """A dataset that cannot be used at all (missing file, no good rows)."""


@dataclasses.dataclass
class DataStats:
    """Counts of rows read, kept and skipped, per skip reason.

    A row is either kept, bad (it cannot become a record) or dropped (a valid record
    removed by deduplication or the train/eval overlap check, see `dedup.py`), so
    `rows_read == rows_kept + rows_bad + rows_dropped`.

    Attributes:
      rows_read: rows seen (blank JSONL lines are not rows).
      rows_kept: rows that became records and were kept.
      bad_by_reason: bad rows per reason, e.g. {"missing_field:prompt": 3}.
      dropped_by_reason: valid rows dropped per reason: "duplicate", "conflicting_answer",
        "eval_overlap".
      flagged_by_reason: kept rows that a check flagged but was told to keep, per reason
        ("eval_overlap" with `data.drop_eval_overlap=false`).
      examples: "file:line: error" for the first `max_examples` bad rows.
      max_examples: how many bad rows (and, separately, conflicting answers) are logged verbatim.
      drops_logged: conflicting answers logged so far.
    """

    rows_read: int = 0
    rows_kept: int = 0
    bad_by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    dropped_by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    flagged_by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: list[str] = dataclasses.field(default_factory=list)
    max_examples: int = 5
    drops_logged: int = 0

    @property
    def rows_bad(self) -> int:
        return sum(self.bad_by_reason.values())

    @property
    def rows_dropped(self) -> int:
        return sum(self.dropped_by_reason.values())

    @property
    def skipped_by_reason(self) -> collections.Counter:
        """Every row not kept, per reason (bad and dropped together)."""
        return self.bad_by_reason + self.dropped_by_reason

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

    def record_dropped(self, location: str, reason: str, message: str) -> None:
        """Counts one valid row dropped as a repeat; a conflicting answer is logged (first few)."""
        self.rows_read += 1
        self.dropped_by_reason[reason] += 1
        if reason != DUPLICATE and self.drops_logged < self.max_examples:
            self.drops_logged += 1
            logger.warning("%s: dropped (%s): %s", location, reason, message)

    def drop_kept(self, reason: str, count: int) -> None:
        """Moves `count` kept rows to `dropped_by_reason[reason]` (e.g. train rows found in eval)."""
        if count:
            self.rows_kept -= count
            self.dropped_by_reason[reason] += count

    def merge(self, other: DataStats) -> None:
        """Adds `other`'s counts into this one (used to total over files)."""
        self.rows_read += other.rows_read
        self.rows_kept += other.rows_kept
        self.bad_by_reason.update(other.bad_by_reason)
        self.dropped_by_reason.update(other.dropped_by_reason)
        self.flagged_by_reason.update(other.flagged_by_reason)
        room = self.max_examples - len(self.examples)
        self.examples.extend(other.examples[: max(room, 0)])

    def summary(self) -> str:
        """One line: kept/read and the skip reasons, e.g. "kept 2/7 rows; skipped 5 (duplicate=3, ...)"."""
        skipped = self.skipped_by_reason
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items()))
        text = f"kept {self.rows_kept}/{self.rows_read} rows; skipped {sum(skipped.values())}" + (
            f" ({reasons})" if reasons else "")
        flagged = ", ".join(f"{k}={v}" for k, v in sorted(self.flagged_by_reason.items()))
        return text + (f"; kept but flagged: {flagged}" if flagged else "")

    def as_metrics(self, prefix: str = "data/") -> dict[str, int]:
        """Counts as a flat metrics dict: `{prefix}rows_read`, `rows_kept`, `rows_skipped` and
        `{prefix}skipped/<reason>` per reason (see `metric_reason` for the names), and
        `{prefix}flagged/<reason>` for kept rows a check flagged."""
        metrics = {f"{prefix}rows_read": self.rows_read, f"{prefix}rows_kept": self.rows_kept,
                   f"{prefix}rows_skipped": self.rows_bad + self.rows_dropped}
        for reason, count in sorted(self.skipped_by_reason.items()):
            key = f"{prefix}skipped/{metric_reason(reason)}"
            metrics[key] = metrics.get(key, 0) + count
        metrics.update({f"{prefix}flagged/{metric_reason(k)}": v for k, v in sorted(self.flagged_by_reason.items())})
        return metrics


def metric_reason(reason: str) -> str:
    """A skip reason as a metric-name part of [A-Za-z0-9_/.-] (tensorboard tag characters).

    "missing_field:prompt" -> "missing_field/prompt", "wrong_type:<row>" -> "wrong_type/row",
    "empty:messages[1].content" -> "empty/messages_1.content". Reasons that collapse to one
    name are summed by `DataStats.as_metrics`.
    """
    parts = (_ILLEGAL_METRIC_CHARS.sub("_", part).strip("_") for part in reason.split(":"))
    return "/".join(part.replace("_.", ".") for part in parts if part) or "unknown"


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

        parquet = pq.ParquetFile(path)
        try:
            check_keys(parquet.schema_arrow.names, "columns")
        except BadRowError as e:
            raise DataError(f"{path}: {e.detail}") from e
        row_no = 0
        for batch in parquet.iter_batches(batch_size=1024):
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
                      deduplicator: Deduplicator | None = None) -> tuple[list, DataStats]:
    """Reads one file; returns its records and stats.

    Args:
      path: a .jsonl, .json or .parquet file.
      parse_row: `(row, default_id) -> record`, raising `BadRowError` for a bad row.
      max_examples: bad rows logged verbatim.
      deduplicator: when given, records it has seen before (in this or an earlier file)
        are dropped and counted per reason (`dedup.py`).

    Raises:
      DataError: when the file holds no valid row, or (Parquet) two columns whose names
        differ only in case. A JSON/JSONL row with such keys is a bad row.
    """
    stats = DataStats(max_examples=max_examples)
    records = []
    base = os.path.basename(path)
    parquet = path.endswith(".parquet")  # its column names were checked once, from the schema
    for location, row, parse_error in iter_raw_rows(path):
        if parse_error is not None:
            stats.record_bad(location, "unparsable_json", parse_error, _raw_text(row))
            continue
        if not isinstance(row, Mapping):
            stats.record_bad(location, "wrong_type:<row>", f"expected an object, got {type(row).__name__}",
                             _raw_text(row))
            continue
        try:
            if not parquet:
                check_keys(row, "keys")
            record = parse_row(row, f"{base}:{location.rsplit(':', 1)[1]}")
        except BadRowError as e:
            stats.record_bad(location, e.reason, str(e), _raw_text(row))
            continue
        dropped = deduplicator.check(record, location) if deduplicator is not None else None
        if dropped is not None:
            stats.record_dropped(location, *dropped)
            continue
        stats.record_good()
        records.append(record)
    if not stats.rows_kept and not stats.rows_dropped:
        first = "; ".join(stats.examples[:3]) or "the file is empty"
        raise DataError(f"{path}: no usable rows out of {stats.rows_read} ({stats.summary()}). First errors: {first}")
    return records, stats


def read_records(paths: str | os.PathLike | Sequence[str | os.PathLike], parse_row: RowParser,
                 max_examples: int = 5, deduplicate: bool = True) -> tuple[list, DataStats]:
    """Reads every file in `paths` (see `resolve_paths`), in sorted order per entry.

    With `deduplicate` (the default), a record equal to an earlier one in any file is
    dropped and counted as "duplicate", or "conflicting_answer" when only the answer
    differs (rules in `dedup.py`). DAPO-Math-17k's parquet repeats each of its ~17k
    problems about a hundred times.

    Returns:
      (records in file order, totals over all files). Bad rows are logged and counted;
      a summary line is logged when any row was skipped.

    Raises:
      DataError: a path matching nothing, or a file with no good row.
    """
    total = DataStats(max_examples=max_examples)
    records: list = []
    deduplicator = Deduplicator() if deduplicate else None
    for path in resolve_paths(paths):
        file_records, stats = read_file_records(path, parse_row, max_examples=max_examples,
                                                deduplicator=deduplicator)
        records.extend(file_records)
        total.merge(stats)
        if stats.rows_bad or stats.rows_dropped - stats.dropped_by_reason[DUPLICATE]:
            logger.warning("%s: %s", path, stats.summary())
        elif stats.rows_dropped:
            logger.info("%s: %s", path, stats.summary())
    return records, total
