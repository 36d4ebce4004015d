"""Where a warm start's compile stage goes (issue #18), on CPU or GPU.

Each run is a fresh process building `LLM(model, compile=True)` with every compile cache
warm (one unmeasured start first fills them), with wall-clock timers around Dynamo's
frame compile, our backend, Inductor per unique piece, guard building, AOTAutograd's
cache-key computation and Inductor's CPU vector-ISA probe (CPU only: it compiles and
dlopens a test library per ISA once per process). Trees alternate run by run, so a
shared machine's load hits each alike; figures are medians.

    PYTHONPATH=$PWD python scripts/bench_warm_compile.py --model random:smollm2-135m \\
        [--baseline DIR] [--runs 3] [--device cpu] [--cache DIR] [--json FILE]

`--baseline DIR` runs the llmfast in DIR (e.g. `git archive <commit> | tar -x -C DIR`)
alternately with this tree. `--pieces N` instead times, in one process, how the backend
gets each piece's fake arguments (fake propagation through the split graph vs Dynamo's
recorded values), N times each, pieces not compiled.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (module, attribute path, label): wall time and calls are summed per label.
TIMERS = (
    ("torch._dynamo.convert_frame", "_compile", "dynamo"),
    ("torch._dynamo.output_graph", "OutputGraph.call_user_compiler", "backend"),
    ("torch._dynamo.guards", "CheckFunctionManager.__init__", "guards"),
    ("torch._inductor.cpu_vec_isa", "valid_vec_isa_list", "cpu_vec_isa_probe"),
    ("torch._functorch._aot_autograd.autograd_cache", "autograd_cache_key", "aot_cache_key"),
    ("llmfast.compile.backend", "_compile_with_inductor", "inductor_pieces"),
    ("llmfast.compile.backend", "split_graph", "split_graph"),
)


def _child(model: str, device: str, dtype: str) -> dict:
    times: dict[str, float] = {}

    def timed(label, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[label] = times.get(label, 0.0) + time.perf_counter() - t0
                times[label + "_calls"] = times.get(label + "_calls", 0) + 1
        return wrapper

    for module, path, label in TIMERS:
        try:
            owner = importlib.import_module(module)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            setattr(owner, name, timed(label, getattr(owner, name)))
        except (ImportError, AttributeError):  # another torch: that timer is left out
            pass
    import gc

    gc_start: list[float] = []

    def gc_timer(phase, info):  # collector pauses count wherever they fall
        if phase == "start":
            gc_start.append(time.perf_counter())
        elif gc_start:
            times["gc"] = times.get("gc", 0.0) + time.perf_counter() - gc_start.pop()

    from llmfast.compile import compiled_model

    capture = compiled_model.CompiledModel.capture

    def timed_capture(self, *args, **kwargs):
        t0 = time.perf_counter()
        times["gc"] = 0.0
        gc.callbacks.append(gc_timer)
        try:
            out = capture(self, *args, **kwargs)
        finally:
            gc.callbacks.remove(gc_timer)
        times["compile_stage"] = time.perf_counter() - t0 - self.stats.capture_time_s
        times["summary"] = self.stats.summary()
        return out

    compiled_model.CompiledModel.capture = timed_capture
    from llmfast.llm import LLM

    LLM(model, device=device, dtype=dtype, compile=True, max_model_len=512)
    return times


def _pieces(model: str, device: str, dtype: str, repeats: int) -> dict:
    import torch
    from torch._guards import detect_fake_mode

    from llmfast.compile import backend, compiled_model

    times: dict[str, list[float]] = {"propagated": [], "traced": []}

    class Timing(backend.PiecewiseBackend):
        def __call__(self, gm, example_inputs):
            fake_mode = detect_fake_mode(example_inputs)
            fake = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
                    for x in example_inputs]
            traced_piece_args = backend.traced_piece_args
            for _ in range(repeats):
                for mode in times:
                    split, kinds = backend.split_graph(gm, self.targets)
                    compiler = backend._PieceCompiler(split, kinds, lambda p, a: p.forward, None)
                    if mode == "propagated":
                        backend.traced_piece_args = lambda piece: None
                    t0 = time.perf_counter()
                    with fake_mode:
                        compiler.compile_all(fake)
                    times[mode].append(time.perf_counter() - t0)
                    backend.traced_piece_args = traced_piece_args
            return super().__call__(gm, example_inputs)

    compiled_model.PiecewiseBackend = functools.partial(Timing, piece_compiler="eager")
    from llmfast.llm import LLM

    LLM(model, device=device, dtype=dtype, compile=True, max_model_len=512)
    return {mode: statistics.median(t) for mode, t in times.items()} | {"runs": times}


def _run(tree: Path, args: argparse.Namespace, cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "LLMFAST_CACHE": cache}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", out.name,
                        "--model", args.model, "--device", args.device, "--dtype", args.dtype],
                       env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another llmfast tree, run alternately")
    parser.add_argument("--cache", help="LLMFAST_CACHE for the runs (default: a fresh one)")
    parser.add_argument("--pieces", type=int, metavar="N")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.child).write_text(json.dumps(_child(args.model, args.device, args.dtype)))
        return
    if args.pieces:
        print(json.dumps(_pieces(args.model, args.device, args.dtype, args.pieces)))
        return
    trees = {"this": REPO} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    cache = args.cache or tempfile.mkdtemp(prefix="llmfast_warm_compile_")
    for tree in trees.values():  # fill the caches (cold start, not measured)
        _run(tree, args, cache)
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            results[name].append(_run(tree, args, cache))
    keys = ("compile_stage", "dynamo", "backend", "inductor_pieces", "cpu_vec_isa_probe",
            "aot_cache_key", "guards", "split_graph", "gc")
    print(f"{args.model} on {args.device}, warm, median of {args.runs} (s):")
    print(f"{'':22}" + "".join(f"{name:>12}" for name in trees))
    for key in keys:
        row = [statistics.median(r.get(key, 0.0) for r in results[name]) for name in trees]
        print(f"{key:22}" + "".join(f"{v:12.2f}" for v in row))
    for name in trees:
        print(f"{name}: {results[name][-1].get('summary', '')}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
