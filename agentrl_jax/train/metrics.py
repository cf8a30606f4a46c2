"""Metrics: tensorboardX events, a JSONL file, a console progress line with ETA, step timers.

`MetricsWriter(logdir)` writes, on process 0 only:
  - tensorboardX scalars, histograms and text (sample trajectories) under `logdir`;
  - `logdir/metrics.jsonl`: one object per `write` call, {"step", "time", **scalars}, with jax/numpy
    values converted to Python numbers and non-finite values written as null;
  - `logdir/samples.jsonl`: the `write_text` entries {"step", "tag", "text"};
  - a console line per `console_every` steps: step/total, s/step, ETA and a few key metrics.
Non-finite scalars are written (NaN/inf in tensorboard, null in JSON) and counted in
`nonfinite_count`; they never raise. On other processes every method is a no-op.

Names: every metric, histogram and text tag passes through `metric_name`, so
`metrics.jsonl`, `samples.jsonl` and the event files carry the same name. Tensorboard
tags allow letters, digits, `_`, `-`, `.` and `/` (no leading `/`); anything else
becomes `_` (logged once per name). Our own names are legal already (`eval/pass_at_1`).

Resume: `MetricsWriter(logdir, purge_step=s)` first drops the JSONL rows of steps >= s
(the steps a killed run logged after its last checkpoint) and opens the event file with
tensorboardX's `purge_step`, which tells TensorBoard (and `read_tensorboard`) to drop the
earlier events of those steps. `purge_step=0` starts over: the old files are removed.

`StepTimer` accumulates wall time per phase of a step:

    timer = StepTimer()
    with timer("rollout"):
        trajectories = run_agent_loop(...)
    with timer("update"):
        state, metrics = train_step(state, batch)
        jax.block_until_ready(metrics)   # time the work, not the async dispatch
    writer.write(step, {**metrics, **timer.as_metrics(prefix="time/")})

`read_tensorboard(logdir)` reads the event files back (no tensorflow/tensorboard needed).
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import logging
import math
import numbers
import os
import re
import struct
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_CONSOLE_KEYS = ("loss", "reward/mean", "eval/pass_at_1", "grad_norm", "response_length/mean", "kl")
_MAX_NONFINITE_WARNINGS = 5
# What tensorboard accepts in a tag (tensorboardX's `_clean_tag` rewrites anything else).
_ILLEGAL_TAG_CHARACTERS = re.compile(r"[^-/\w.]")
_renamed_warned: set[str] = set()


def metric_name(name: str) -> str:
    """`name` as a legal tensorboard tag; the one name used in every output.

    Characters other than letters, digits, `_`, `-`, `.` and `/` become `_`; leading `/`
    are dropped ("eval/pass@1" -> "eval/pass_1"). A rename is logged once per name.

    Raises:
      ValueError: a name that is empty once cleaned.
    """
    clean = _ILLEGAL_TAG_CHARACTERS.sub("_", name).lstrip("/")
    if not clean:
        raise ValueError(f"metric name {name!r} is empty once cleaned; use letters, digits, _ - . /")
    if clean != name and name not in _renamed_warned:
        _renamed_warned.add(name)
        logger.warning("metric name %r is not a legal tensorboard tag; written as %r everywhere", name, clean)
    return clean


def _clean_names(items: Mapping[str, Any]) -> dict[str, Any]:
    """{metric_name(key): value}; two keys that clean to one name are an error naming both."""
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in items.items():
        clean = metric_name(key)
        if clean in out:
            raise ValueError(f"metrics {origin[clean]!r} and {key!r} both become {clean!r}; rename one")
        out[clean], origin[clean] = value, key
    return out


def to_number(value: Any, key: str) -> int | float:
    """A scalar metric (Python/NumPy/JAX number, or a one-element array) as a Python number.

    Integers and bools stay ints; everything else becomes float (possibly NaN/inf).

    Raises:
      ValueError: an array with more than one element (naming `key`).
      TypeError: a non-numeric value (naming `key`).
    """
    if isinstance(value, (bool, numbers.Integral)):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.size != 1:
            raise ValueError(f"metric {key!r} must be a scalar, got an array of shape {array.shape}")
        if array.dtype.kind in "biu":
            return int(array.reshape(()))
        if array.dtype.kind == "f" or array.dtype == jax.numpy.bfloat16:
            return float(array.reshape(()))
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


def format_duration(seconds: float) -> str:
    """Seconds as H:MM:SS (or "?" when unknown)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _format_value(value: int | float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


class MetricsWriter:
    """Writes metrics to tensorboardX, `metrics.jsonl` and the console; only where `enabled`.

    Args:
      logdir: output directory (created).
      enabled: write anything at all; defaults to `jax.process_index() == 0`.
      total_steps: for the progress fraction and ETA (None: no ETA).
      console_every: print the progress line when `step % console_every == 0` (0: never).
      console_keys: metrics shown on the console line when present; default
        `DEFAULT_CONSOLE_KEYS`, falling back to the first four keys when none is present.
      console: stream for the progress line (default stdout).
      flush_secs: tensorboardX flush period.
      purge_step: None appends to what `logdir` holds. An int s (resuming at step s):
        JSONL rows of steps >= s are dropped and tensorboard hides the older events of
        those steps; 0 removes the earlier files (a run that starts over).
    """

    def __init__(self, logdir: str | os.PathLike, *, enabled: bool | None = None, total_steps: int | None = None,
                 console_every: int = 1, console_keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
                 console: TextIO | None = None, flush_secs: int = 30, purge_step: int | None = None):
        self.logdir = os.fspath(logdir)
        self.enabled = jax.process_index() == 0 if enabled is None else bool(enabled)
        self.total_steps = total_steps
        self.console_every = console_every
        self.console_keys = tuple(console_keys)
        self.console = console or sys.stdout
        self.nonfinite_count = 0
        self.nonfinite_by_key: collections.Counter = collections.Counter()
        self._step_times: collections.deque = collections.deque(maxlen=20)
        self._tb = None
        self._jsonl = self._samples = None
        if self.enabled:
            from tensorboardX import SummaryWriter

            os.makedirs(self.logdir, exist_ok=True)
            if purge_step is not None:
                _purge(self.logdir, int(purge_step))
            # Event file names hold the time in whole seconds: a counter keeps a second file of the
            # same second from replacing the first, and sorts after it (readers go in name order).
            earlier = len(glob.glob(os.path.join(self.logdir, "events.out.tfevents.*")))
            self._tb = SummaryWriter(self.logdir, flush_secs=flush_secs, purge_step=purge_step or None,
                                     filename_suffix=f".{earlier}" if earlier else "")
            self._jsonl = open(os.path.join(self.logdir, "metrics.jsonl"), "a", encoding="utf-8")
            self._samples = open(os.path.join(self.logdir, "samples.jsonl"), "a", encoding="utf-8")

    def _count_nonfinite(self, key: str, what: str) -> None:
        self.nonfinite_count += 1
        self.nonfinite_by_key[key] += 1
        if self.nonfinite_count <= _MAX_NONFINITE_WARNINGS:
            logger.warning("non-finite %s in metric %r (written as null / NaN and counted)", what, key)

    def write(self, step: int, scalars: Mapping[str, Any], *, timed: bool = True) -> None:
        """Writes one step's scalar metrics everywhere and maybe prints the progress line.

        Args:
          step: the global step.
          scalars: name -> number (Python, NumPy or JAX scalar). Names use "/" groups,
            e.g. "reward/mean", "time/rollout".
          timed: False for a one-off record written before the steps run (the data counts at
            step 0): it prints no progress line and stays out of the s/step estimate, which a
            write before a long SFT stage or at step 0 of a resumed run would distort.
        """
        if not self.enabled:
            return
        values = {key: to_number(value, key) for key, value in _clean_names(scalars).items()}
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in values.items():
            self._tb.add_scalar(key, value, int(step))
            if isinstance(value, float) and not math.isfinite(value):
                self._count_nonfinite(key, "value")
                record[key] = None
            else:
                record[key] = value
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()
        if not timed:
            return
        self._step_times.append((time.perf_counter(), int(step)))
        if self.console_every and int(step) % self.console_every == 0:
            print(self.progress_line(int(step), values), file=self.console, flush=True)

    def seconds_per_step(self) -> float:
        """Mean wall seconds per step over the recent `write` calls (NaN until two calls)."""
        if len(self._step_times) < 2:
            return float("nan")
        (t0, s0), (t1, s1) = self._step_times[0], self._step_times[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else float("nan")

    def progress_line(self, step: int, values: Mapping[str, int | float]) -> str:
        """"step 12/100 (12%) | 3.21 s/step | eta 0:04:42 | loss 0.12 | ..." for these values."""
        per_step = self.seconds_per_step()
        parts = [f"step {step}" + (f"/{self.total_steps} ({100 * step / self.total_steps:.0f}%)"
                                   if self.total_steps else "")]
        parts.append(f"{per_step:.3g} s/step" if math.isfinite(per_step) else "- s/step")
        if self.total_steps:
            parts.append(f"eta {format_duration((self.total_steps - step) * per_step)}")
        keys = [k for k in self.console_keys if k in values] or list(values)[:4]
        parts.extend(f"{k} {_format_value(values[k])}" for k in keys)
        return " | ".join(parts)

    def write_histograms(self, step: int, arrays: Mapping[str, Any]) -> None:
        """Writes one histogram per name; non-finite entries are dropped and counted."""
        if not self.enabled:
            return
        for key, array in _clean_names(arrays).items():
            values = np.asarray(array, dtype=np.float64).ravel()
            finite = values[np.isfinite(values)]
            if finite.size < values.size:
                self._count_nonfinite(key, f"entries ({values.size - finite.size} of {values.size})")
            if finite.size:
                self._tb.add_histogram(key, finite, int(step))

    def write_text(self, step: int, texts: Mapping[str, str]) -> None:
        """Writes text entries (e.g. sample trajectories) to tensorboard and `samples.jsonl`.

        Tensorboard renders text as Markdown; the JSONL file keeps it verbatim.
        """
        if not self.enabled:
            return
        for tag, text in _clean_names(texts).items():
            if not isinstance(text, str):
                raise TypeError(f"text {tag!r} must be a string, got {type(text).__name__}")
            self._tb.add_text(tag, text, int(step))
            self._samples.write(json.dumps({"step": int(step), "tag": tag, "text": text}) + "\n")
        self._samples.flush()

    def flush(self) -> None:
        if self.enabled:
            self._tb.flush()
            self._jsonl.flush()
            self._samples.flush()

    def close(self) -> None:
        """Flushes and closes every output (safe to call twice)."""
        if self.enabled and self._tb is not None:
            self._tb.close()
            self._jsonl.close()
            self._samples.close()
            self._tb = None
            self.enabled = False

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class StepTimer:
    """Wall time per named phase of a step; phases may nest and repeat (times add up)."""

    def __init__(self):
        self._seconds: dict[str, float] = collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start

    def as_metrics(self, prefix: str = "time/", reset: bool = True) -> dict[str, float]:
        """{prefix + phase: seconds}; clears the timers unless `reset=False`."""
        metrics = {f"{prefix}{name}": seconds for name, seconds in self._seconds.items()}
        if reset:
            self.reset()
        return metrics

    def reset(self) -> None:
        self._seconds.clear()


def _purge(logdir: str, purge_step: int) -> None:
    """Drops what a writer resuming at `purge_step` must not keep (see `MetricsWriter`)."""
    if purge_step == 0:
        for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
            os.remove(path)
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(logdir, name)
        if not os.path.exists(path):
            continue
        kept, dropped = [], 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                    step = purge_step
                if step < purge_step:
                    kept.append(line)
                else:
                    dropped += 1
        if dropped:
            logger.info("%s: dropped %d row(s) of steps >= %d (logged after the checkpoint resumed from)",
                        path, dropped, purge_step)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(path + ".tmp", path)


def _iter_records(path: str) -> Iterator[bytes]:
    """The payloads of a TFRecord file (uint64 length, crc, payload, crc).

    A record cut short at the end of the file (the writer was killed mid-write) ends the
    file, with a warning, as TensorBoard's reader does.
    """
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8]) if len(header) == 12 else (-1,)
            payload = f.read(length) if length >= 0 else b""
            if length < 0 or len(payload) < length or len(f.read(4)) < 4:
                logger.warning("%s: the last record is cut short (a killed writer); reading up to it", path)
                return
            yield payload


def read_tensorboard(logdir: str | os.PathLike) -> dict[str, list[tuple[int, Any]]]:
    """Reads every event file in `logdir` back: tag -> [(step, value), ...] in write order.

    As TensorBoard does, a `SessionLog.START` event at step s (a writer opened with
    `purge_step=s`) drops the values of steps >= s read before it. A scalar's value is a float, a text's a str, a histogram's a dict with "min", "max",
    "num", "sum", "sum_squares" and "bucket_limit"/"bucket" lists.
    """
    from tensorboardX.proto import event_pb2

    values: dict[str, list[tuple[int, Any]]] = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(os.fspath(logdir), "events.out.tfevents.*"))):
        for payload in _iter_records(path):
            event = event_pb2.Event.FromString(payload)
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                for tag in values:
                    values[tag] = [(s, v) for s, v in values[tag] if s < event.step]
                continue
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    item: Any = value.simple_value
                elif kind == "histo":
                    histo = value.histo
                    item = {"min": histo.min, "max": histo.max, "num": histo.num, "sum": histo.sum,
                            "sum_squares": histo.sum_squares, "bucket_limit": list(histo.bucket_limit),
                            "bucket": list(histo.bucket)}
                elif kind == "tensor" and value.tensor.string_val:
                    item = value.tensor.string_val[0].decode("utf-8")
                else:
                    continue
                tag = value.tag[: -len("/text_summary")] if value.tag.endswith("/text_summary") else value.tag
                values[tag].append((int(event.step), item))
    return {tag: items for tag, items in values.items() if items}
