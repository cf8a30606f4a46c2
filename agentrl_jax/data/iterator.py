"""A checkpointable, host-sharded iterator over batches of records (grain MapDataset).

Pipeline: `MapDataset.source(records).shuffle(seed).repeat(num_epochs)` (grain reseeds the
shuffle each epoch) -> global batches of `batch_size * shard_count` records (lists, not
stacked arrays: prompts are strings) -> host `shard_index` keeps every `shard_count`-th
record of each global batch. So hosts see disjoint records, and the union of the host
batches of step k is exactly the batch a single host with the global batch size would
see at step k: the data order does not depend on the number of hosts.

`get_state()` returns a small JSON-able dict for the checkpoint; `set_state()` on a
fresh iterator over the same records continues with exactly the next batch. The state
carries a fingerprint (record count and ids digest, seed, batch size, sharding) and
restoring into an iterator built differently is an error naming the mismatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import grain

Record = TypeVar("Record")


def _records_digest(records: Sequence[Any]) -> str:
    digest = hashlib.sha1()
    for record in records:
        digest.update(str(getattr(record, "id", record)).encode("utf-8", "replace"))
        digest.update(b"\0")
    return digest.hexdigest()[:16]


#: Fingerprint fields of one host's share, not of the global stream of batches.
_HOST_FIELDS = ("batch_size", "shard_index", "shard_count")


def _host_slice(shard_index: int, shard_count: int):
    def take(global_batch: list) -> list:
        return global_batch[shard_index::shard_count]

    return take


class BatchIterator(Generic[Record], Iterator[list[Record]]):
    """Shuffled, batched, sharded, checkpointable iteration over records.

    Args:
      records: the dataset (e.g. from `load_task_records`); kept in memory.
      batch_size: records per batch on this host (the global batch is
        `batch_size * shard_count`).
      seed: shuffle seed; each epoch gets a different order derived from it.
      shuffle: False keeps file order (evaluation).
      num_epochs: None repeats forever (training); an int stops after that many epochs.
      drop_remainder: drop a final partial global batch (only happens with finite epochs).
        When kept, the last host batches may be shorter than `batch_size` or empty.
      shard_index: this host's index, usually `jax.process_index()`.
      shard_count: number of hosts, usually `jax.process_count()`.

    Raises:
      ValueError: a bad batch size or shard, or fewer records than one global batch.
    """

    def __init__(self, records: Sequence[Record], *, batch_size: int, seed: int = 0, shuffle: bool = True,
                 num_epochs: int | None = None, drop_remainder: bool = True, shard_index: int = 0,
                 shard_count: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if shard_count < 1 or not 0 <= shard_index < shard_count:
            raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index=} {shard_count=}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be None (forever) or >= 1, got {num_epochs}")
        global_batch = batch_size * shard_count
        if len(records) < global_batch and drop_remainder:
            raise ValueError(f"{len(records)} records cannot fill one global batch of {global_batch} "
                             f"(batch_size={batch_size} x shard_count={shard_count})")
        self.records = records
        self.batch_size = batch_size
        self.global_batch_size = global_batch
        self.fingerprint = {
            "num_records": len(records), "records_digest": _records_digest(records), "seed": int(seed),
            "shuffle": bool(shuffle), "num_epochs": num_epochs, "batch_size": batch_size,
            "shard_index": shard_index, "shard_count": shard_count, "drop_remainder": bool(drop_remainder),
        }
        dataset = grain.MapDataset.source(records)
        if shuffle:
            dataset = dataset.shuffle(seed=seed)
        if num_epochs != 1:
            dataset = dataset.repeat(num_epochs)
        dataset = dataset.batch(global_batch, drop_remainder=drop_remainder, batch_fn=list)
        dataset = dataset.map(_host_slice(shard_index, shard_count))
        # Records are plain Python objects: one reader thread and a short buffer suffice.
        self._dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4))
        self._iterator = iter(self._dataset)
        self.batches_served = 0

    def __iter__(self) -> BatchIterator[Record]:
        return self

    def __next__(self) -> list[Record]:
        batch = next(self._iterator)
        self.batches_served += 1
        return batch

    @property
    def epoch(self) -> float:
        """Epochs consumed so far (fractional), from the batches served."""
        return self.batches_served * self.global_batch_size / len(self.records)

    def get_state(self) -> dict[str, Any]:
        """A JSON-able state: pass to `set_state` to continue with the next batch."""
        return {"grain": self._iterator.get_state(), "batches_served": self.batches_served,
                "fingerprint": dict(self.fingerprint)}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a `get_state()` result taken from an identically built iterator.

        Raises:
          ValueError: the state came from other records, seed, batch size or sharding.
        """
        saved = dict(state.get("fingerprint", {}))
        if "shard_count" in saved and "batch_size" in saved:
            # The position is counted in global batches: a state resumes on any number of hosts
            # that deals the same global batches (a checkpoint of 2 hosts on 1, and back).
            saved["global_batch_size"] = saved["batch_size"] * saved["shard_count"]
        now = {k: v for k, v in self.fingerprint.items() if k not in _HOST_FIELDS}
        now["global_batch_size"] = self.global_batch_size
        mismatched = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if mismatched:
            detail = ", ".join(f"{k}: saved {s!r} vs now {n!r}" for k, (s, n) in mismatched.items())
            raise ValueError(f"data iterator state does not match this dataset/iterator ({detail}); "
                             "rebuild the iterator with the saved settings or start the data from scratch")
        self._iterator = iter(self._dataset)
        self._iterator.set_state(state["grain"])
        self.batches_served = int(state["batches_served"])
