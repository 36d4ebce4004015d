"""Reading safetensors files straight into tensors that already exist on their device.

The format: 8 bytes (little-endian u64) header length N, N bytes of JSON mapping each
tensor name to {dtype, shape, data_offsets: [begin, end]} (offsets relative to the
data, which starts at 8 + N), then the data.

Why not `safe_open(...).get_tensor`: it hands out a tensor over the memory-mapped file,
which the copy into the parameter then faults in page by page; `pread` into the
destination's own bytes reads each byte once, and was measured 5-9x faster on our CPU
VM (profiles/startup-cpu.md). For a CUDA destination the bytes go through two pinned
staging buffers in turn: the file read of one chunk overlaps the host-to-device copy of
the previous one, and a checkpoint dtype that differs from the parameter's is cast on
the device. Never more than two chunks of the model are on the host at once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._staging = None
        self._pinned, self._events = [], []

    def read(self, fd: int, entry: TensorEntry, dest: torch.Tensor) -> None:
        """Fill `dest` (contiguous, same number of elements) with the entry's values,
        cast to dest's dtype."""
        assert dest.is_contiguous() and dest.numel() * entry.dtype.itemsize == entry.nbytes
        if self.staged:
            self._read_staged(fd, entry, dest)
        else:
            self._read_cpu(fd, entry, dest)

    def _read_cpu(self, fd: int, entry: TensorEntry, dest: torch.Tensor) -> None:
        if dest.dtype == entry.dtype:
            _pread_into(fd, _byte_view(dest), entry.offset)
            return
        if self._staging is None or self._staging.numel() < entry.nbytes:
            self._staging = torch.empty(entry.nbytes, dtype=torch.uint8)
        raw = self._staging[: entry.nbytes]
        _pread_into(fd, _byte_view(raw), entry.offset)
        dest.copy_(raw.view(entry.dtype).view(dest.shape))

    def _read_staged(self, fd: int, entry: TensorEntry, dest: torch.Tensor) -> None:
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
            _pread_into(fd, _byte_view(pinned), entry.offset + first * itemsize)
            src = pinned.view(entry.dtype)
            if dest.dtype == entry.dtype:
                flat[first:last].copy_(src, non_blocking=on_cuda)
            else:  # to the device as stored, then cast there
                flat[first:last].copy_(src.to(dest.device, non_blocking=on_cuda))
            if on_cuda:
                self._events[turn].record()
