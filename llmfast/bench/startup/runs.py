"""Start-up, cold and warm: two fresh processes with the same model and engine
arguments, the first on empty caches, the second reusing what the first left.

Both children get the same cache root: `LLMFAST_CACHE` (llmfast's compile cache, which
holds Inductor's FX-graph, AOTAutograd and autotuning caches), `TORCHINDUCTOR_CACHE_DIR`
(Inductor outside llmfast's compile) and `TRITON_CACHE_DIR` (llmfast's own Triton
kernels). The cold child starts with the root empty; the warm one is the same command
again. Each child (`llmfast.cli.startup_child`) writes its figures to a JSON file;
nothing is printed by this module.

Python's bytecode is not one of those caches: a cold start finds it as the installation
has it (a pip install compiles it). Where the packages have none and llmfast keeps its
own (utils/bytecode.py), the children share the user's, and a first process fills it
with a start's imports before the cold child runs (bench/startup/bytecode_prime.py);
the report gives the seconds that took and the modules it compiled
(`bytecode_prime_s`, `bytecode_primed_modules`: about what a first start on such a
machine adds).

The model is resolved here, once: a default or GGUF model is fetched or converted into
the user's cache before the children run, and they get its directory, so an empty
cache root never means a download.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmfast.bench.workload import BenchError
from llmfast.utils.bytecode import bytecode_cache_dir
from llmfast.utils.paths import cache_dir

# The stages, in start-up order (LLMEngine.startup_times' keys: the runner's, then the
# engine's tokenizer and scheduler).
STARTUP_STAGES = ("load", "setup", "tokenizer", "tune", "gemv", "precompile", "profile",
                  "compile", "capture", "kv_cache", "tokenizer_wait", "scheduler")


@dataclass
class StartupRun:
    """One fresh process: where its time went until the first token."""

    stages: dict[str, float]  # seconds per runner stage (STARTUP_STAGES, those that ran)
    import_s: float  # process spawn -> llmfast and torch imported, ready to build
    engine_s: float  # LLM(...) construction: the stages plus tokenizer, scheduler, ...
    first_step_s: float  # one greedy token of a short prompt, after construction
    time_to_first_token_s: float  # process spawn -> that token
    process_s: float  # process spawn -> exit
    compile_cache_hits: int  # Inductor FX-graph + AOTAutograd cache hits while compiling
    compile_cache_misses: int
    cache_files: int  # files under the cache root when the process ended
    device: str = ""
    device_facts: dict[str, Any] = field(default_factory=dict)  # rank 0's (environment.py)
    compile_summary: str = ""  # pieces, CUDA graphs of each kind, capture s and MiB
    # {"precompiled", "compiled_at_launch"}: Triton variants compiled in threads ahead of
    # their launches and at them (RunnerInfo.triton_variants); None: no precompile
    triton_variants: dict[str, int] | None = None
    engine_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class StartupReport:
    model: str
    engine_args: dict[str, Any]
    cache_root: str
    cold: StartupRun
    warm: StartupRun
    # Seconds the imports took to fill llmfast's bytecode cache before the cold start,
    # and how many modules' bytecode they wrote (0: an earlier start had); None where
    # Python keeps bytecode itself (module doc).
    bytecode_prime_s: float | None = None
    bytecode_primed_modules: int | None = None


def cache_env(root: Path) -> dict[str, str]:
    """The variables that put every cache a start-up fills under `root`. Python's
    bytecode stays where it is: a prefix this process was given or set for llmfast's
    bytecode cache (PYTHONPYCACHEPREFIX) passes on to the children (module doc)."""
    return {
        "LLMFAST_CACHE": str(root / "llmfast"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
    }


def child_env(root: Path) -> dict[str, str]:
    """The environment of a child with its caches under `root`. Where this process keeps
    its bytecode in llmfast's cache the child writes there too, whatever
    PYTHONDONTWRITEBYTECODE says (as utils/bytecode.py decides for this process): else
    what the priming left out would compile again in the warm start."""
    env = {**os.environ, **cache_env(root)}
    if keeps_own_bytecode():
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def keeps_own_bytecode() -> bool:
    """This process keeps its bytecode in llmfast's cache (utils/bytecode.py), and so
    will the children it starts."""
    return os.environ.get("PYTHONPYCACHEPREFIX") == str(bytecode_cache_dir(cache_dir()))


def prime_bytecode(env: dict[str, str], modules: tuple[str, ...] = (),
                   timeout_s: float | None = None) -> tuple[float, int]:
    """(seconds, modules written): a fresh process importing what a start-up imports
    (or `modules`), writing their bytecode where `env`'s PYTHONPYCACHEPREFIX says
    (bench/startup/bytecode_prime.py)."""
    prefix = Path(env["PYTHONPYCACHEPREFIX"])
    before = _count_bytecode(prefix)
    t0 = time.perf_counter()
    _run_module("llmfast.bench.startup.bytecode_prime", list(modules), env, timeout_s,
                "priming the bytecode")
    return time.perf_counter() - t0, _count_bytecode(prefix) - before


def _count_bytecode(prefix: Path) -> int:
    return sum(1 for _ in prefix.rglob("*.pyc")) if prefix.is_dir() else 0


def _run_module(module: str, args: list[str], env: dict[str, str], timeout_s: float | None,
                what: str, writes: Path | None = None) -> None:
    """`python -m module args` in a fresh process; a one-line BenchError naming `what`
    when it runs past `timeout_s`, fails, or leaves no `writes` file."""
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], env=env,
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what} ran past {timeout_s:g} s") from None
    if proc.returncode != 0 or (writes is not None and not writes.is_file()):
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        raise BenchError(f"{what} failed: "
                         + (_error_text(lines[-1]) if lines else f"exit status {proc.returncode}"))


def _error_text(last_line: str) -> str:
    """A traceback's last line without the module path of one of llmfast's own errors,
    whose messages say what to change: `llmfast.config.ConfigError: max-model-len ...`
    -> `max-model-len ...` (another type, e.g. torch's, stays named)."""
    match = re.fullmatch(r"llmfast(?:\.\w+)+: (.+)", last_line.strip())
    return match.group(1) if match else last_line


def resolved_model(spec: str | None) -> str:
    """What the children load: a random preset as is, anything else as its local
    directory (fetched or converted now, into the user's cache)."""
    from llmfast.models.sources.model_source import resolve_model

    source = resolve_model(spec)
    return source.spec if source.is_random else str(source.path)


def run_startup(model: str | None, engine_args: dict[str, Any],
                cache_root: Path | None = None, timeout_s: float | None = None
                ) -> StartupReport:
    """Start the engine twice in fresh processes, cold then warm. `cache_root` must be
    empty or absent (default: a temporary directory, removed afterwards)."""
    target = resolved_model(model)
    if cache_root is not None:
        if cache_root.exists() and any(cache_root.iterdir()):
            raise BenchError(f"{cache_root} is not empty: a cold start needs an empty cache")
        return _cold_and_warm(target, engine_args, cache_root, timeout_s)
    with tempfile.TemporaryDirectory(prefix="llmfast_startup_") as tmp:
        return _cold_and_warm(target, engine_args, Path(tmp), timeout_s)


def _cold_and_warm(model: str, engine_args: dict[str, Any], root: Path,
                   timeout_s: float | None) -> StartupReport:
    root.mkdir(parents=True, exist_ok=True)
    prime_s = primed = None
    if keeps_own_bytecode():
        with tempfile.TemporaryDirectory(prefix="llmfast_prime_") as scratch:
            # (Its other caches apart: nothing of it may land in the cold start's root.)
            prime_s, primed = prime_bytecode(child_env(Path(scratch)), timeout_s=timeout_s)
    cold = run_child(model, engine_args, root, timeout_s)
    warm = run_child(model, engine_args, root, timeout_s)
    return StartupReport(model, dict(engine_args), str(root), cold, warm, prime_s, primed)


def run_child(model: str, engine_args: dict[str, Any], root: Path,
              timeout_s: float | None = None) -> StartupRun:
    """One fresh `python -m llmfast.cli.startup_child` with its caches under `root`."""
    env = child_env(root)
    with tempfile.TemporaryDirectory(prefix="llmfast_child_") as tmp:
        out = Path(tmp) / "startup.json"
        spec = json.dumps({"model": model, "engine_args": engine_args})
        spawned = time.time()
        _run_module("llmfast.cli.startup_child", [spec, str(out)], env, timeout_s,
                    "the start-up process", writes=out)
        exited = time.time()
        data = json.loads(out.read_text())
    return StartupRun(
        stages=data["stages"],
        import_s=data["ready_epoch"] - spawned,
        engine_s=data["engine_s"],
        first_step_s=data["first_step_s"],
        time_to_first_token_s=data["first_token_epoch"] - spawned,
        process_s=exited - spawned,
        compile_cache_hits=data["compile_cache_hits"],
        compile_cache_misses=data["compile_cache_misses"],
        cache_files=sum(1 for p in root.rglob("*") if p.is_file()),
        device=data["device"],
        device_facts=data["device_facts"],
        compile_summary=data.get("compile_summary", ""),
        triton_variants=data.get("triton_variants"),
        engine_config=data["engine_config"],
    )
