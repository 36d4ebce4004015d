"""Bytecode for the imports of a start-up, kept where Python would otherwise keep none.

A start imports ~2,500 modules (torch, its compiler stack, transformers). Python reads
each one's cached bytecode (`__pycache__/*.pyc`) or compiles it from source. Where the
installed packages have no bytecode beside them and Python may not write any (the
environment sets PYTHONDONTWRITEBYTECODE, as container images often do, or the
site-packages directory is read-only), every process compiles them all again: 6.5 s of
`compile()` in a warm start of the 1B shape on an H100 (2026-11-26, a cProfile of
gpu_check's former `startup_profile` step; profiles/startup.md).

`keep_bytecode` then points Python at a bytecode cache of llmfast's own
(`<cache dir>/pycache`, Python's `sys.pycache_prefix` mechanism, as PYTHONPYCACHEPREFIX
does): the first start compiles and writes there, later starts read. Nothing is written
beside the installed sources. The `llmfast` command and the start-up benchmark's child
process call it first thing, before the heavy imports; a program using the Python API
can set PYTHONPYCACHEPREFIX itself. LLMFAST_BYTECODE_CACHE=0 turns it off.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def bytecode_cache_dir(cache_dir: Path) -> Path:
    """Where `keep_bytecode(cache_dir)` keeps bytecode (absolute: the processes it
    starts may run elsewhere)."""
    return (cache_dir / "pycache").absolute()


def keep_bytecode(cache_dir: Path, probe: str = "torch") -> bool:
    """Keep the bytecode of later imports under `cache_dir / "pycache"` when the package
    `probe` (one the start-up imports, not yet imported) has no bytecode beside its
    source and Python would write none there. Returns whether it did. Call it before
    the imports it is for; a PYTHONPYCACHEPREFIX of the user's own wins."""
    if os.environ.get("LLMFAST_BYTECODE_CACHE", "1") == "0":
        return False
    prefix = bytecode_cache_dir(cache_dir)
    if sys.pycache_prefix == str(prefix):
        # Set by the llmfast process that started this one (PYTHONPYCACHEPREFIX): this
        # one writes there too, whatever PYTHONDONTWRITEBYTECODE says.
        sys.dont_write_bytecode = False
        return True
    if sys.pycache_prefix:
        return False
    try:
        spec = importlib.util.find_spec(probe)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    source = Path(spec.origin)
    if Path(importlib.util.cache_from_source(str(source))).is_file():
        return False  # bytecode beside the sources (the usual pip install)
    if not sys.dont_write_bytecode and os.access(source.parent, os.W_OK):
        return False  # Python writes it there itself on this first import
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)  # for the processes it starts
    logger.debug("no bytecode beside %s and none written there: keeping it under %s",
                 source.parent, prefix)
    return True
