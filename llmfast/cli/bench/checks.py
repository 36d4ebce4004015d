"""`llmfast bench`'s checks before anything runs: output files that can be written, and
no option that the chosen mode would ignore. A benchmark can take an hour; a typo in a
path or a flag meant for another mode should fail in its first second."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from llmfast.bench import BenchError

# What --plot can write (matplotlib picks the format from the extension) and --json.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
JSON_SUFFIXES = (".json",)

# Options read by some modes only (None: --startup alone), by parameter name.
MODE_OPTIONS: dict[str, tuple[str, frozenset[str]]] = {
    "sizes": ("--sizes", frozenset({"sweep"})),
    "context": ("--context", frozenset({"sweep"})),
    "steps": ("--steps", frozenset({"sweep"})),
    "modes": ("--modes", frozenset({"sweep"})),
    "num_prompts": ("--num-prompts", frozenset({"throughput", "latency"})),
    "input_len": ("--input-len", frozenset({"throughput", "latency"})),
    "output_len": ("--output-len", frozenset({"throughput", "latency"})),
    "random_range_ratio": ("--random-range-ratio", frozenset({"throughput", "latency"})),
    "baseline": ("--baseline", frozenset({"throughput"})),
    "hf_batch_size": ("--hf-batch-size", frozenset({"throughput"})),
    "request_rate": ("--request-rate", frozenset({"latency"})),
}


def check_mode_options(mode: str | None, given: Iterable[str]) -> None:
    """An option the user gave that `mode` does not read is an error, not a silent no-op
    (`--baseline hf` on a sweep would otherwise print a sweep and no baseline)."""
    for name in given:
        if name not in MODE_OPTIONS:
            continue
        flag, modes = MODE_OPTIONS[name]
        if mode not in modes:
            used = " or ".join(f"--mode {m}" for m in sorted(modes))
            this = f"--mode {mode}" if mode else "--startup alone"
            raise BenchError(f"{flag} applies to {used}, not to {this}")


def check_counts(counts: dict[str, int]) -> None:
    """Each count flag (`--steps`: its value) at least 1, named alone with its value."""
    for flag, value in counts.items():
        if value < 1:
            raise BenchError(f"{flag} must be >= 1, got {value}")


def check_output_paths(json_path: Path | None, plot_path: Path | None) -> None:
    """Fail before a long benchmark, not after it: each output file writable, with an
    extension naming its format (a plot without one would be written under another name)."""
    for path, flag, suffixes in ((json_path, "--json", JSON_SUFFIXES),
                                 (plot_path, "--plot", PLOT_SUFFIXES)):
        if path is None:
            continue
        if path.suffix.lower() not in suffixes:
            got = f"has extension {path.suffix!r}" if path.suffix else "has no extension"
            raise BenchError(f"{flag} {path} {got}; use {' or '.join(suffixes)}")
        check_writable(path, flag)
    if plot_path is not None:  # else found missing only after the whole benchmark ran
        try:
            import matplotlib.figure  # noqa: F401
        except ImportError:
            raise BenchError("--plot needs matplotlib: pip install matplotlib, or drop "
                             "--plot") from None
    if json_path is not None and json_path.is_file() and not _is_bench_report(json_path):
        raise BenchError(f"--json {json_path} exists and is not an llmfast bench report; "
                         "give another name (a report of an earlier run is replaced)")


def _is_bench_report(path: Path) -> bool:
    """An earlier run's --json (which a rerun replaces) or an empty file, not some other
    file a typo would overwrite."""
    try:
        text = path.read_text(encoding="utf-8")
        return not text.strip() or "llmfast_bench_version" in json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        return False


def check_writable(path: Path, flag: str = "") -> None:
    what = f"{flag} {path}".strip()
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise BenchError(f"{what} is a directory; give a file name")
    if not parent.is_dir():
        raise BenchError(f"cannot write {what}: directory {parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise BenchError(f"cannot write {what}: the file is not writable")
    # A file made and removed: os.access says yes to root, and to /proc or a read-only
    # mount, where the write after the run would fail.
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".llmfast-write-test-"):
            pass
    except OSError as e:
        raise BenchError(f"cannot write {what}: cannot create files in {parent} "
                         f"({e.strerror or e})") from None


def save_elsewhere(text: str, name: str) -> Path | None:
    """Where a report that could not be written where asked is kept instead: a new file
    in the temp directory (None if even that fails)."""
    stem, suffix = os.path.splitext(name)
    try:
        fd, path = tempfile.mkstemp(prefix=f"{stem}-", suffix=suffix)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError:
        return None
    return Path(path)
