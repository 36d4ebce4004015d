"""The compile cache: one directory per (model config, dtype, device type, torch and
triton versions, llmfast's own source), under `llmfast.utils.paths.cache_dir() / "compile"`.

We do not serialise compiled code ourselves. Inductor already has an on-disk FX-graph
cache (and AOTAutograd a cache on top) keyed by the graph, its input shapes and the
compiler setup; we only point it at our keyed directory while our backend compiles, so
a warm start recompiles nothing (Dynamo still re-traces the model: a few seconds).

Concurrent starts: Inductor writes each entry to a per-process temporary file and
renames it into place (`torch._inductor.codecache.write_atomic`), and builds C++/Triton
artefacts under per-key file locks, so two processes compiling into one directory at
once may both compile but never leave a torn entry.

Old keyed directories (after an llmfast or torch upgrade) are left behind; deleting
`<cache_dir>/compile` is always safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from llmfast.config import CompileConfig, ModelConfig, dtype_name
from llmfast.kernels.layers.kernel_choice import layer_kernels_enabled
from llmfast.kernels.triton_mode import triton_interpret_enabled
from llmfast.utils.paths import cache_dir

logger = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # .../llmfast


# The sources that decide what gets compiled: the model, its ops and kernels, the
# backend itself, and the dataclasses they read. Editing the CLI or the scheduler does
# not invalidate the cache.
COMPILED_SOURCES = ("models", "kernels", "compile", "graphs", "distributed",
                    "attention/metadata.py",
                    "config.py")


def source_hash(package_dir: Path = _PACKAGE_DIR) -> str:
    """sha256 over the llmfast sources in `COMPILED_SOURCES` (paths and bytes), so an
    edited model or op definition never meets code compiled from the old one."""
    h = hashlib.sha256()
    files: list[Path] = []
    for name in COMPILED_SOURCES:
        path = package_dir / name
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    for path in files:
        if not path.is_file():
            continue
        h.update(str(path.relative_to(package_dir)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _hardware(device_type: str) -> str:
    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} sm_{major}{minor}"
    if device_type == "cpu":
        return torch.backends.cpu.get_cpu_capability()
    return device_type


def compile_cache_key(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device_type: str,
    compile_config: CompileConfig,
) -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # CPU-only installs may lack triton
        triton_version = "none"
    fields = {
        "model": dataclasses.asdict(model_config),
        "dtype": dtype_name(dtype),
        "device": device_type,
        # Inductor's code is built for this GPU's architecture or this CPU's vector ISA;
        # a warm start loads it without Inductor's own checks (compile/precompiled.py).
        "hardware": _hardware(device_type),
        "torch": torch.__version__,
        "triton": triton_version,
        "splitting_ops": sorted(compile_config.splitting_ops),
        "llmfast": source_hash(),
        # Inside the same op nodes, the layers' triton ops trace to llmfast's kernels or
        # to torch ops (kernels/layers/kernel_choice.py): Inductor's cache keys cannot tell.
        "layer_kernels": layer_kernels_enabled(),
        # Likewise on the CPU under Triton's interpreter (kernels/triton_mode.py). A
        # warm start loads the graph traced under this key without tracing again
        # (compile/precompiled.py): whatever changes the trace must be in it.
        "triton_interpret": triton_interpret_enabled(),
    }
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def compile_cache_dir(key: str) -> Path:
    """Where Inductor's caches go for this key; not created here."""
    return cache_dir() / "compile" / key


@contextlib.contextmanager
def _env_var(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _clear_inductor_path_caches() -> None:
    # Inductor memoises paths derived from its cache dir; clear them when the dir changes.
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:
        return
    clear_caches()


@contextlib.contextmanager
def inductor_cache(directory: Path | None) -> Iterator[None]:
    """While compiling: Inductor's caches live in `directory` (on), or are off (None).

    Inductor reads `TORCHINDUCTOR_CACHE_DIR` on every use, so setting it for the duration
    of the compile and restoring it afterwards redirects the FX-graph, AOTAutograd and
    (on CUDA) Triton caches without touching the process's environment for good.
    """
    from torch._inductor import config as inductor_config

    if directory is None:
        with inductor_config.patch(force_disable_caches=True):
            yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    patches = {"fx_graph_cache": True, "fx_graph_remote_cache": False}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_env_var("TORCHINDUCTOR_CACHE_DIR", str(directory)))
        stack.callback(_clear_inductor_path_caches)
        _clear_inductor_path_caches()
        stack.enter_context(inductor_config.patch(patches))
        with contextlib.suppress(AttributeError, KeyError):
            from torch._functorch import config as functorch_config

            stack.enter_context(functorch_config.patch(enable_autograd_cache=True))
        yield


def cache_counters() -> dict[str, int]:
    """Cumulative cache hit/miss counts of this process (take differences)."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "fx_hits": int(inductor["fxgraph_cache_hit"]),
        "fx_misses": int(inductor["fxgraph_cache_miss"]),
        "aot_hits": int(aot["autograd_cache_hit"]),
        "aot_misses": int(aot["autograd_cache_miss"]),
    }
