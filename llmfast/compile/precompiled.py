"""A warm start without Dynamo (issue #18): what a cold start traced and compiled, saved
beside the compile cache, and loaded by the next start in place of tracing again.

A warm start with Inductor's caches alone still runs Dynamo over the whole model (2.7 s
of the 1B shape's warm start on an H100, 3.4 s for SmolLM2 on the CPU VM), only to
arrive at the graph it traced last time. Saved here, under the compile cache's keyed
directory (so a changed model, dtype, torch or llmfast source never meets it):

    precompiled/<model fingerprint>/   (graph_inputs.model_fingerprint: weights' shapes...)
      manifest.json   format, torch version, how to gather the graph's inputs from a call
                      (compile/graph_inputs.py), which output is the result, and per
                      compiled piece its artifact and token-count argument
      graph.pkl       Dynamo's graph split at the attention calls, before compiling
      piece-<i>.bin   Inductor's artifact of each distinct piece (standalone_compile)

What stands in for Dynamo's guards:
- the directory: the compile cache's key (model config, dtype, device type and
  hardware, torch/triton, llmfast's compiled sources, the kernel switches) and the
  model's fingerprint (graph_inputs.model_fingerprint: the weights' dtypes, devices and
  shapes, the KV caches' fixed sizes, every module's plain scalar attributes);
- at the first call, every input against what the trace fixed (dtype, device, the
  sizes and strides the graph does not leave free: graph_inputs.input_patterns), and
  that call itself: if the loaded graph fails on it, the entry is discarded, the start
  traces with Dynamo, and a `<fingerprint>.failed` marker keeps later starts from
  saving and loading one again (it would likely fail the same way);
- at every call, the attention metadata's None fields against the trace's: a call
  unlike the trace falls back to Dynamo (before any piece runs).
The cold start saves only after calling the split graph on the gathered inputs and
getting Dynamo's result bit for bit. Not used with tensor parallelism (the ranks would
have to agree on loading, and the check's extra forward runs collectives).
`LLMFAST_PRECOMPILED=0` turns it off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from llmfast.compile.graph_inputs import InputSlot

logger = logging.getLogger(__name__)

FORMAT = 1
DIRNAME = "precompiled"


def precompiled_enabled() -> bool:
    return os.environ.get("LLMFAST_PRECOMPILED", "1") != "0"


@dataclasses.dataclass(frozen=True)
class PieceRecord:
    artifact: int  # index into the artifacts: identical layers share one
    token_index: int | None  # the argument whose leading dim is the token count


@dataclasses.dataclass
class Precompiled:
    # Dynamo's graph split at the attention calls: as loaded, nothing compiled in it; as
    # saved, the cold start's (pickled before compiling: `save`'s graph_bytes).
    split: fx.GraphModule
    slots: list[InputSlot]
    none_fields: tuple[str, ...]  # metadata fields that were None when traced
    patterns: list[dict[str, Any]]  # graph_inputs.input_patterns of the traced inputs
    output_index: int  # the graph output the forward returns
    pieces: list[PieceRecord]
    artifacts: list[Any]  # callables (Inductor's CompiledArtifact)


def dump_graph(split: fx.GraphModule) -> bytes:
    """The split graph and its submodules' graphs, node by node (torch's GraphPickler:
    nodes and targets as they are; pickling a GraphModule itself would save its code
    and re-trace that symbolically at load, which does not give back the same graph),
    without node metadata (fake tensors, stack traces): the assembly needs none."""
    from torch.fx._graph_pickler import GraphPickler, Options

    options = Options(ops_filter=None, node_metadata_key_filter=lambda key: False)
    return GraphPickler.dumps(split, options)


def _load_graph(data: bytes) -> fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    split = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    if not isinstance(split, fx.GraphModule):
        raise TypeError(f"graph.pkl holds a {type(split).__name__}, not a GraphModule")
    for module in (split, *split.children()):
        if isinstance(module, fx.GraphModule):
            module.recompile()
    return split


def save(directory: Path, record: Precompiled, graph_bytes: bytes) -> bool:
    """Write `record`, its split graph as `graph_bytes` (`dump_graph` of it before its
    pieces were compiled in), to `directory` (atomically: a temporary directory renamed
    into place; a concurrent start that got there first wins). False if anything
    failed."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(directory.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{directory.name}.tmp-", dir=directory.parent))
    try:
        (tmp / "graph.pkl").write_bytes(graph_bytes)
        for i, artifact in enumerate(record.artifacts):
            artifact.save(path=str(tmp / f"piece-{i}.bin"), format="binary")
        manifest = {
            "format": FORMAT,
            "torch": torch.__version__,
            "slots": [slot.to_json() for slot in record.slots],
            "none_fields": list(record.none_fields),
            "patterns": record.patterns,
            "output_index": record.output_index,
            "pieces": [dataclasses.asdict(p) for p in record.pieces],
            "num_artifacts": len(record.artifacts),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        os.replace(tmp, directory)
    except Exception as exc:  # noqa: BLE001 - saving is an optimisation; never fatal
        shutil.rmtree(tmp, ignore_errors=True)
        if (directory / "manifest.json").is_file():
            return True  # another process saved the same thing first
        logger.warning("could not save the precompiled model to %s: %s", directory, exc)
        return False
    return True


def _remove_stale_temporaries(parent: Path, max_age_s: float = 3600.0) -> None:
    """Temporary and discarded directories older than an hour: left by a process
    killed while saving or discarding."""
    now = time.time()
    for path in parent.glob("*.tmp-*"):
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > max_age_s:
                shutil.rmtree(path, ignore_errors=True)


def load(directory: Path) -> Precompiled | None:
    """What `save` wrote, or None (absent, another format or torch, unreadable)."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT or manifest.get("torch") != torch.__version__:
            return None
        from torch._inductor import CompiledArtifact

        split = _load_graph((directory / "graph.pkl").read_bytes())
        artifacts = [CompiledArtifact.load(path=str(directory / f"piece-{i}.bin"),
                                           format="binary")
                     for i in range(manifest["num_artifacts"])]
        return Precompiled(
            split=split,
            slots=[InputSlot.from_json(s) for s in manifest["slots"]],
            none_fields=tuple(manifest["none_fields"]),
            patterns=list(manifest["patterns"]),
            output_index=int(manifest["output_index"]),
            pieces=[PieceRecord(**p) for p in manifest["pieces"]],
            artifacts=artifacts,
        )
    except Exception as exc:  # noqa: BLE001 - a bad entry means tracing again, not failing
        logger.warning("ignoring the precompiled model in %s: %s", directory, exc)
        return None


def discard(directory: Path) -> None:
    """Remove an entry `load` could not use (damaged, an older format, made for other
    inputs), so that this start's trace can save a new one in its place. Renamed aside
    first: a process reading it meanwhile finds it whole or not at all."""
    if not directory.exists():
        return
    logger.info("discarding the unusable precompiled model in %s", directory)
    aside = Path(tempfile.mkdtemp(prefix=f"{directory.name}.tmp-", dir=directory.parent))
    try:
        os.replace(directory, aside / "old")
    except OSError:
        pass  # another process moved or replaced it first
    shutil.rmtree(aside, ignore_errors=True)


def _failure_marker(directory: Path) -> Path:
    return directory.with_name(f"{directory.name}.failed")


def mark_failed(directory: Path, exc: BaseException) -> None:
    """Record that the entry in `directory` failed when run: `failed_before` then keeps
    later starts from saving and loading one for this fingerprint (delete the marker,
    or the compile cache, to try again)."""
    with contextlib.suppress(OSError):
        _failure_marker(directory).write_text(f"{type(exc).__name__}: {exc}\n")


def failed_before(directory: Path) -> bool:
    return _failure_marker(directory).is_file()


def output_index(result: Sequence[Any], expected: torch.Tensor) -> int | None:
    """The position in the graph's outputs of the forward's result, judged by value (the
    assembled graph's re-run against Dynamo's call); None unless exactly one matches."""
    matches = [i for i, value in enumerate(result)
               if isinstance(value, torch.Tensor) and value.shape == expected.shape
               and value.dtype == expected.dtype and torch.equal(value, expected)]
    return matches[0] if len(matches) == 1 else None
