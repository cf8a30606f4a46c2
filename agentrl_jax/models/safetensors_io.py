"""Safetensors files, read and written without the safetensors package: an 8-byte header length,
a JSON header, raw little-endian data.

Reading maps the files with ``numpy.memmap`` (slicing a tensor reads only the bytes it needs),
because safetensors' numpy backend cannot return bfloat16; bfloat16 comes back as
``ml_dtypes.bfloat16``. Writing streams tensors one at a time from thunks, so the host never
holds more than one tensor of a model being saved.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {  # the header's dtype names
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint does not match the model it is loaded into."""


class SafetensorsCheckpoint:
    """Read-only view of the safetensors files of an HF directory (single or index-sharded)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        index_path = os.path.join(self.directory, "model.safetensors.index.json")
        single_path = os.path.join(self.directory, "model.safetensors")
        if os.path.exists(index_path):
            with open(index_path) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.exists(single_path):
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {self.directory}"
            )
        self._entries: dict[str, tuple[str, np.dtype, tuple[int, ...], int]] = {}
        self._maps: dict[str, np.memmap] = {}
        for name in files:
            self._read_header(os.path.join(self.directory, name))

    def _read_header(self, path: str) -> None:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        for tensor, meta in header.items():
            if meta["dtype"] not in DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {tensor} has unsupported dtype {meta['dtype']}"
                )
            start = 8 + header_len + meta["data_offsets"][0]
            self._entries[tensor] = (path, DTYPES[meta["dtype"]], tuple(meta["shape"]), start)

    def names(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def get(self, name: str) -> np.ndarray:
        """A memory-mapped (lazy) array; slicing it reads only the needed bytes."""
        path, dtype, shape, start = self._entries[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        count = math.prod(shape)
        raw = self._maps[path][start : start + count * dtype.itemsize]
        return raw.view(dtype).reshape(shape)


def write_safetensors(
    directory: str, tensors: list, np_dtype: np.dtype, max_shard_bytes: int = 2 * 1024**3
) -> None:
    """Write ``(HF name, shape, thunk)`` tensors as ``model.safetensors``, or as several files
    with an index above ``max_shard_bytes``; each thunk is called once, when its tensor is written."""
    shards: list[list] = [[]]
    shard_bytes = 0
    for entry in tensors:
        nbytes = math.prod(entry[1]) * np_dtype.itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += nbytes
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        _write_safetensors(os.path.join(directory, file), shard, np_dtype)
        weight_map.update({name: file for name, _, _ in shard})
    if len(shards) > 1:
        total = sum(math.prod(shape) for _, shape, _ in tensors) * np_dtype.itemsize
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _write_safetensors(path: str, entries: list, np_dtype: np.dtype) -> None:
    """Stream tensors into one safetensors file, materializing one at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        nbytes = math.prod(shape) * np_dtype.itemsize
        header[name] = {
            "dtype": DTYPE_NAMES[np_dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape, thunk in entries:
            tensor = np.ascontiguousarray(thunk())
            if tensor.shape != tuple(shape):
                raise CheckpointError(
                    f"save_hf_checkpoint: {name} has shape {tensor.shape}, expected {shape}"
                )
            f.write(tensor.tobytes())  # safetensors is little-endian, as are the hosts we run on
