"""The packed linears of a GGUF file, kept between starts: decoding the blocks and
repacking them for torch's int4 kernel takes seconds at every start (~7 s for the default
model on the 2-core dev VM), reading the result back a fraction of that.

One safetensors file per key under `cache_dir() / "gguf-packed"` (beside the compile
cache, `compile/cache.py`), named `<GGUF sha256 prefix>-<key>.safetensors`. The key covers
what decides the bytes: the GGUF file's contents (sha256), `PACK_LAYOUT_VERSION`, torch's
version (the kernel's packed layout is torch's) and the CPU's vector ISA (torch packs
differently per ISA). Writes go to a temporary file renamed into place, so a concurrent
start never reads a torn file; a file that cannot be read or written is logged and the
layers are packed as without a cache. Deleting the directory is always safe.

A write prunes what can no longer be read (`prune_stale`): the same GGUF file's packs
under other keys (an older layout or torch: ~100 MB each for the default model), files
named before the name carried the GGUF's hash, and temporaries a crashed write left
(older than STALE_TMP_SECONDS, so a concurrent start's write in progress is kept).
Packs of other GGUF files stay. Two installs with different torch versions sharing one
cache directory repack the same file in turn.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from llmfast.kernels.cpu.int4_linear import PackedInt4
from llmfast.utils.paths import cache_dir

logger = logging.getLogger(__name__)

# Bump when what `pack_int4` (or `nibble_planes`) makes of the same blocks changes.
PACK_LAYOUT_VERSION = 2  # 2: rows padded to 32
_TENSORS = ("weight_packed", "scales_and_zeros", "x_index")
# The file name's leading characters of the GGUF file's sha256: what names the packs of
# one GGUF file (and so which of them a new write makes stale).
_GGUF_PREFIX = 16
# A temporary file this old is a crashed write's (a write takes seconds).
STALE_TMP_SECONDS = 3600


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def pack_cache_path(gguf_path: Path) -> Path:
    sha = file_sha256(gguf_path)
    fields = {"gguf_sha256": sha, "layout": PACK_LAYOUT_VERSION,
              "torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability()}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "gguf-packed" / f"{sha[:_GGUF_PREFIX]}-{key}.safetensors"


def prune_stale(path: Path) -> list[Path]:
    """Delete, beside the pack `path` (just written), the files no start will read
    again (module doc); returns them. Failures are logged, not raised."""
    prefix = path.name.split("-", 1)[0]
    removed = []
    try:
        others = [p for p in path.parent.iterdir() if p != path and p.is_file()]
    except OSError as e:
        logger.warning("gguf: cannot list the packed-weight cache %s: %s", path.parent, e)
        return removed
    now = time.time()
    for other in others:
        try:
            if other.suffix == ".tmp":
                stale = now - other.stat().st_mtime > STALE_TMP_SECONDS
            elif other.suffix == ".safetensors":
                owner, sep, _ = other.name.partition("-")
                stale = not sep or owner == prefix  # an older naming, or this GGUF's
            else:
                stale = False
            if stale:
                other.unlink()
                removed.append(other)
        except OSError as e:  # gone already (a concurrent prune), or not ours to delete
            logger.debug("gguf: cannot prune %s: %s", other, e)
    if removed:
        logger.info("gguf: pruned %d stale packed-weight cache file(s) in %s", len(removed),
                    path.parent)
    return removed


def load_packed(path: Path) -> dict[str, PackedInt4] | None:
    """module name -> its packed tensors, or None where there is no usable file."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            features = json.loads(f.metadata()["features"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return {module: PackedInt4(tensors[f"{module}.weight_packed"],
                                   tensors[f"{module}.scales_and_zeros"],
                                   tensors.get(f"{module}.x_index"), in_f, out_f)
                for module, (in_f, out_f) in features.items()}
    except Exception as e:  # a torn or foreign file: pack again (and overwrite it)
        logger.warning("gguf: ignoring the packed-weight cache %s: %s", path, e)
        return None


def save_packed(path: Path, packed: dict[str, PackedInt4]) -> None:
    from safetensors.torch import save_file

    tensors = {f"{module}.{name}": getattr(p, name).contiguous()
               for module, p in packed.items() for name in _TENSORS
               if getattr(p, name) is not None}
    features = {module: (p.in_features, p.out_features) for module, p in packed.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"features": json.dumps(features)})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        logger.warning("gguf: cannot write the packed-weight cache %s: %s", path, e)
        return
    prune_stale(path)
