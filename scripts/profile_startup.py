"""Where a whole warm start goes (issue #18): a cProfile of `LLM(...)` and of the first
token in a fresh process whose caches a cold start just filled, and `-X importtime` of
`import llmfast.llm`. The stage table of `llmfast bench --startup` says how long each
stage took; this says what ran inside the seconds no stage claims (on an H200, 8.5 s of
a 17 s warm engine start before the runner's set-up, tokenizer and scheduler became
stages of their own).

    PYTHONPATH=$PWD python scripts/profile_startup.py --model random:llama-3.2-1b \\
        --dtype bfloat16 [--device cuda] [--top 45] [--out DIR] [-- ENGINE FLAGS]

Engine flags after `--` go to the engine as `llmfast` commands take them (on CPU,
`-- --compile` profiles a compiled start).

Writes DIR/startup_profile.md (the tables) and DIR/startup_warm.prof (pstats) when
--out is given. cProfile inflates Python-heavy parts (Dynamo, fake tensors) about 2x:
compare entries with each other, and read real seconds from the stage table.
"""

from __future__ import annotations

import argparse
import json
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

from llmfast.bench.startup.runs import child_env, resolved_model, run_child
from llmfast.engine_args import engine_kwargs_from_argv


def import_times(env: dict[str, str], top: int) -> list[tuple[float, str]]:
    """(cumulative s, module) of the slowest imports under `import llmfast.llm`, after
    the bytecode set-up the start-up's child process does first (utils/bytecode.py)."""
    code = ("from llmfast.utils.bytecode import keep_bytecode; "
            "from llmfast.utils.paths import cache_dir; keep_bytecode(cache_dir()); "
            "import llmfast.llm")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code],
                          env=env, capture_output=True, text=True, check=True)
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    return sorted(rows, reverse=True)[:top]


def profile_table(stats: pstats.Stats, by: str, top: int, min_s: float) -> str:
    """The `top` entries by cumulative ("cumulative") or own ("own") time, at least
    `min_s` each, as `cum s  own s  calls  file:line(function)` lines."""
    rows = []
    for (path, line, func), (_, calls, own, cum, _) in stats.stats.items():
        value = cum if by == "cumulative" else own
        if value >= min_s:
            rows.append((value, cum, own, calls, f"{_short(path)}:{line}({func})"))
    rows.sort(reverse=True)
    return "\n".join(f"{cum:8.2f} {own:8.2f} {calls:8d}  {where}"
                     for _, cum, own, calls, where in rows[:top])


def _short(path: str) -> str:
    """A path from its package down (site-packages and the checkout cut off; the
    checkout by its own location, as its folder is often itself named `llmfast`)."""
    checkout = str(Path(__file__).resolve().parents[1]) + "/"
    if path.startswith(checkout):
        return path[len(checkout):]
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("engine_flags", nargs="*", help="engine flags, after --")
    args = parser.parse_args()
    engine_args = {"dtype": args.dtype, **engine_kwargs_from_argv(args.engine_flags)}
    if args.device:
        engine_args["device"] = args.device
    model = resolved_model(args.model)
    report = [f"# Warm start profile: {args.model} ({args.dtype})", ""]
    with tempfile.TemporaryDirectory(prefix="llmfast_startup_profile_") as tmp:
        root = Path(tmp)
        cold = run_child(model, engine_args, root)
        report.append(f"Cold start (fills the caches): engine {cold.engine_s:.2f} s, "
                      f"time to first token {cold.time_to_first_token_s:.2f} s.")
        prof = root / "warm.prof"
        spec = json.dumps({"model": model, "engine_args": engine_args})
        env = child_env(root)
        subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m",
                        "llmfast.bench.startup.child", spec, str(root / "warm.json")],
                       env=env, check=True)
        warm = json.loads((root / "warm.json").read_text())
        stages = ", ".join(f"{k} {v:.2f}" for k, v in warm["stages"].items())
        report += [f"Warm start under cProfile: engine {warm['engine_s']:.2f} s; stages: "
                   f"{stages}.", ""]
        stats = pstats.Stats(str(prof))
        header = f"{'cum s':>8} {'own s':>8} {'calls':>8}  function"
        report += ["## Cumulative (entries >= 0.2 s)", "", "```", header,
                   profile_table(stats, "cumulative", args.top, 0.2), "```", "",
                   "## Own time (entries >= 0.05 s)", "", "```", header,
                   profile_table(stats, "own", args.top, 0.05), "```", ""]
        report += ["## Slowest imports under `import llmfast.llm` (cumulative s)", ""]
        report += [f"- {s:.3f} {name}" for s, name in import_times(env, 20)]
        text = "\n".join(report) + "\n"
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "startup_profile.md").write_text(text)
            (args.out / "startup_warm.prof").write_bytes(prof.read_bytes())


if __name__ == "__main__":
    main()
