"""Reading safetensors files straight into tensors that already exist on their device.

The format: 8 bytes (little-endian u64) header length N, N bytes of JSON mapping each
tensor name to {dtype, shape, data_offsets: [begin, end]} (offsets relative to the
data, which starts at 8 + N), then the data.

Why not `safe_open(...).get_tensor`: it hands out a tensor over the memory-mapped file,
which the copy into the parameter then faults in page by page; `pread` into the
destination's own bytes reads each byte once, and was measured 5-9x faster on our CPU
VM (profiles/startup.md). For a CUDA destination the bytes go through two pinned
staging buffers in turn: the file read of one chunk overlaps the host-to-device copy of
the previous one, and a checkpoint dtype that differs from the parameter's is cast on
the device. Never more than two chunks of the model are on the host at once.

A tensor-parallel rank reads only its slice of a tensor (`ByteRuns`): a row slice is one
byte range, a column slice one range per row; nothing else of the tensor is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

import torch

if TYPE_CHECKING:
    from llmfast.models.sharding import ShardSlice

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 << 20  # the format's own limit
CHUNK_BYTES = 64 << 20  # per pinned staging buffer


class SafetensorsFormatError(ValueError):
    """A file that is not valid safetensors (corrupt or truncated); one line."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class SafetensorsFile:
    path: Path
    entries: dict[str, TensorEntry]  # in file order
    data_bytes: int

    @classmethod
    def open(cls, path: Path) -> SafetensorsFile:
        """Read and check the header: every tensor's bytes lie inside the file and
        match its dtype and shape."""
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsFormatError("shorter than a safetensors header")
            header_len = int.from_bytes(head, "little")
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise SafetensorsFormatError(f"header length {header_len} exceeds the file")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SafetensorsFormatError(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise SafetensorsFormatError("header is not a JSON object")
        start = 8 + header_len
        data_bytes = size - start
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            entries[name] = _entry(name, info, start, data_bytes)
        order = sorted(entries.values(), key=lambda e: e.offset)
        return cls(path, {e.name: e for e in order}, data_bytes)


def _entry(name: str, info: object, start: int, data_bytes: int) -> TensorEntry:
    try:
        dtype_name = info["dtype"]  # type: ignore[index]
        shape = tuple(int(d) for d in info["shape"])  # type: ignore[index]
        begin, end = (int(x) for x in info["data_offsets"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        raise SafetensorsFormatError(f"{name}: malformed header entry") from None
    if dtype_name not in DTYPES:
        raise SafetensorsFormatError(f"{name}: unsupported dtype {dtype_name}")
    dtype = DTYPES[dtype_name]
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
        raise SafetensorsFormatError(f"{name}: data offsets do not match its dtype and shape")
    if end > data_bytes:
        raise SafetensorsFormatError(f"{name}: data runs past the end of the file")
    return TensorEntry(name, dtype, shape, start + begin, end - begin)


@dataclass(frozen=True)
class ByteRuns:
    """Where a (slice of a) tensor's bytes lie in the file: `count` runs of `run_bytes`,
    the i-th at `first + i * stride`, in the order the destination holds them."""

    first: int
    run_bytes: int
    stride: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.run_bytes * self.count

    def pieces(self, begin: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(file offset, destination offset, bytes) covering destination bytes
        [begin, end). Worked example, runs of 8 bytes with stride 32 from 100,
        begin 4, end 20: (104, 4, 4), (132, 8, 8), (164, 16, 4)."""
        pos = begin
        while pos < end:
            run, within = divmod(pos, self.run_bytes)
            n = min(self.run_bytes - within, end - pos)
            yield self.first + run * self.stride + within, pos, n
            pos += n


def byte_runs(entry: TensorEntry, shard: ShardSlice | None = None) -> ByteRuns:
    """The bytes of `entry`, or of its `shard` (rows: dim 0, columns of a 2-D tensor:
    dim 1). Worked example, a [4, 6] float32 tensor at offset 0, columns 2..4: runs of
    12 bytes at 8, 32, 56, 80 (row stride 24)."""
    if shard is None:
        return ByteRuns(entry.offset, entry.nbytes, entry.nbytes, 1)
    row_bytes = entry.nbytes // entry.shape[0]
    if shard.dim == 0:
        size = shard.size * row_bytes
        return ByteRuns(entry.offset + shard.start * row_bytes, size, size, 1)
    if shard.dim != 1 or len(entry.shape) != 2:
        raise ValueError(f"{entry.name}: cannot slice dim {shard.dim} of {entry.shape}")
    itemsize = entry.dtype.itemsize
    return ByteRuns(entry.offset + shard.start * itemsize, shard.size * itemsize, row_bytes,
                    entry.shape[0])


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise SafetensorsFormatError("the file ended early")
        done += n


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable (numpy has no bfloat16: go through
    uint8)."""
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class TensorReader:
    """Reads entries into destination tensors on one device. Use as a context manager:
    leaving it waits for the last device copies.

    `staged`: through the two staging chunks (default: on CUDA only). On CPU it runs the
    same chunk arithmetic without pinning or events, which is how the tests check it."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES,
                 staged: bool | None = None) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.staged = device.type != "cpu" if staged is None else staged
        self._staging: torch.Tensor | None = None  # CPU, for casts on CPU
        self._pinned: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._turn = 0
        self.bytes_read = 0  # from files, by this reader

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._staging = None
        self._pinned, self._events = [], []

    def read(self, fd: int, entry: TensorEntry, dest: torch.Tensor,
             shard: ShardSlice | None = None) -> None:
        """Fill `dest` (contiguous, as many elements as the entry or its `shard`) with
        the entry's values (or the shard's), cast to dest's dtype."""
        runs = byte_runs(entry, shard)
        assert dest.is_contiguous() and dest.numel() * entry.dtype.itemsize == runs.nbytes
        if self.staged:
            self._read_staged(fd, entry, runs, dest)
        else:
            self._read_cpu(fd, entry, runs, dest)

    def _read_runs(self, fd: int, runs: ByteRuns, view: memoryview, begin: int) -> None:
        """Destination bytes [begin, begin + len(view)) into `view`."""
        for offset, at, n in runs.pieces(begin, begin + len(view)):
            _pread_into(fd, view[at - begin: at - begin + n], offset)
        self.bytes_read += len(view)

    def _read_cpu(self, fd: int, entry: TensorEntry, runs: ByteRuns,
                  dest: torch.Tensor) -> None:
        if dest.dtype == entry.dtype:
            self._read_runs(fd, runs, _byte_view(dest), 0)
            return
        if self._staging is None or self._staging.numel() < runs.nbytes:
            self._staging = torch.empty(runs.nbytes, dtype=torch.uint8)
        raw = self._staging[: runs.nbytes]
        self._read_runs(fd, runs, _byte_view(raw), 0)
        dest.copy_(raw.view(entry.dtype).view(dest.shape))

    def _read_staged(self, fd: int, entry: TensorEntry, runs: ByteRuns,
                     dest: torch.Tensor) -> None:
        on_cuda = dest.device.type == "cuda"
        if not self._pinned:
            self._pinned = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=on_cuda)
                            for _ in range(2)]
            if on_cuda:
                self._events = [torch.cuda.Event() for _ in range(2)]
                for event in self._events:
                    event.record()
        itemsize = entry.dtype.itemsize
        chunk_elems = self.chunk_bytes // itemsize
        flat = dest.view(-1)
        # Worked example: 100 MB of bf16 with 64 MiB buffers: elements [0, 33554432)
        # through buffer 0, then [33554432, 50000000) through buffer 1.
        for first in range(0, flat.numel(), chunk_elems):
            last = min(first + chunk_elems, flat.numel())
            nbytes = (last - first) * itemsize
            turn = self._turn
            self._turn ^= 1
            if on_cuda:
                self._events[turn].synchronize()  # its previous copy has left the buffer
            pinned = self._pinned[turn][:nbytes]
            self._read_runs(fd, runs, _byte_view(pinned), first * itemsize)
            src = pinned.view(entry.dtype)
            if dest.dtype == entry.dtype:
                flat[first:last].copy_(src, non_blocking=on_cuda)
            else:  # to the device as stored, then cast there
                flat[first:last].copy_(src.to(dest.device, non_blocking=on_cuda))
            if on_cuda:
                self._events[turn].record()
