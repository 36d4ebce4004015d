"""The README's chat example as a new user runs it, over several seeds: how many replies
name the right city, how many run to the token limit, how many stop in a loop.

    python -m llmfast.bench.first_run_chat --seeds 1..8 --out profiles/first-run-chat.json

Each seed runs `printf 'What is the capital of France?\\nAnd of Italy?\\n' | python -m
llmfast chat --seed S [extra chat flags]` in a fresh process (the command itself, with its
defaults, on the default model), one at a time. Replies come from stdout (each followed
by an empty line), the per-turn stats line from stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

QUESTIONS = (("What is the capital of France?", "Paris"), ("And of Italy?", "Rome"))
_TOKENS = re.compile(r"· (\d+) tokens ·")


def run_seed(seed: int, extra: list[str], timeout: float = 1800) -> dict:
    """One chat over the questions; per turn: the reply, the right city named or not,
    tokens, and whether it stopped at max tokens or in a loop."""
    script = "".join(question + "\n" for question, _ in QUESTIONS)
    cmd = [sys.executable, "-m", "llmfast", "chat", "--seed", str(seed), *extra]
    done = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=timeout,
                          check=False)
    replies = done.stdout.split("\n\n")[:len(QUESTIONS)]
    stats = [line for line in done.stderr.splitlines() if line.startswith("TTFT")]
    settings = next((line for line in done.stderr.splitlines()
                     if line.startswith("sampling:")), None)
    turns = []
    for (question, city), reply, stat in zip(QUESTIONS, replies, stats):
        tokens = _TOKENS.search(stat)
        turns.append({"question": question, "reply": reply, "city": city,
                      "right_city": city.lower() in reply.lower(),
                      "tokens": int(tokens[1]) if tokens else None,
                      "max_tokens": "stopped at max tokens" in stat,
                      "repeating": "stopped: repeating" in stat, "stats": stat})
    return {"seed": seed, "exit_code": done.returncode, "settings": settings, "turns": turns,
            "stderr_tail": done.stderr[-2000:] if done.returncode else ""}


def summarize(runs: list[dict]) -> dict:
    turns = [t for run in runs for t in run["turns"]]
    return {"replies": len(turns), "right_city": sum(t["right_city"] for t in turns),
            "stopped_at_max_tokens": sum(t["max_tokens"] for t in turns),
            "stopped_repeating": sum(t["repeating"] for t in turns),
            "failed_runs": sum(run["exit_code"] != 0 for run in runs)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1..8", help="a..b (inclusive) or a,b,c")
    parser.add_argument("--out", type=Path, help="write the raw runs and the counts as JSON")
    parser.add_argument("extra", nargs="*", help="more chat flags (after --)")
    args = parser.parse_args(argv)
    if ".." in args.seeds:
        first, last = (int(x) for x in args.seeds.split(".."))
        seeds = list(range(first, last + 1))
    else:
        seeds = [int(x) for x in args.seeds.split(",")]
    runs = []
    for seed in seeds:
        run = run_seed(seed, args.extra)
        runs.append(run)
        marks = " ".join(f"{'ok' if t['right_city'] else 'WRONG'}/{t['tokens']}"
                         + (" LIMIT" if t["max_tokens"] else "")
                         + (" LOOP" if t["repeating"] else "") for t in run["turns"])
        print(f"seed {seed}: {marks}", flush=True)
    report = {"command": "printf 'What is the capital of France?\\nAnd of Italy?\\n' | "
                         "python -m llmfast chat --seed S " + " ".join(args.extra),
              "date": datetime.date.today().isoformat(), "seeds": seeds,
              "summary": summarize(runs), "runs": runs}
    print(json.dumps(report["summary"]))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
