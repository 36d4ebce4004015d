#!/usr/bin/env python3
"""$OUT/report.md from one scripts/gpu_check.sh call: the device lines (`nvidia-smi -L`,
torch, triton, git commit), then per step its exact command, outcome, PASS/FAIL lines
and the table it printed; what profiles/ asks for, ready to be copied there.

    python3 scripts/gpu_report.py /tmp/llmfast_gpu_check > /tmp/llmfast_gpu_check/report.md
"""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path

# Where each step's table sits in its log: the lines from the first match of the
# pattern on (at most `limit` of them); None: the log's last lines.
TABLES: dict[str, tuple[str | None, int]] = {
    "modes": (r"^decode step latency", 12),
    "async": (r"^# async scheduling", 8),
    "load": (r" of weights$", 5),
    "startup": (r"start-up:", 24),
    "sweep": (r"decode sweep", 20),
    "throughput": (r"throughput:", 10),
    "serve": (None, 8),
    "kernels": (None, 20),
}


def _steps(steps_log: str) -> list[tuple[str, str, str]]:
    """(step, command, outcome) in run order, from steps.log."""
    commands: dict[str, str] = {}
    order: list[str] = []
    outcomes: dict[str, str] = {}
    for line in steps_log.splitlines():
        m = re.match(r"=== (\S+) \(limit \d+ s\): (.*)", line)
        if m:
            commands[m.group(1)] = m.group(2)
            order.append(m.group(1))
            continue
        m = re.match(r"=== (\S+): (.*)", line)
        if m:
            outcomes[m.group(1)] = m.group(2)
            if m.group(1) not in commands:
                order.append(m.group(1))
    return [(s, commands.get(s, ""), outcomes.get(s, "not finished")) for s in order]


def _table(step: str, log: Path) -> list[str]:
    if not log.is_file():
        return []
    lines = log.read_text(errors="replace").splitlines()
    pattern, limit = TABLES.get(step.split("_")[0].split("-")[0], (None, 6))
    if pattern is None:
        return lines[-limit:]
    for i, line in enumerate(lines):
        if re.search(pattern, line):
            return lines[i: i + limit]
    return lines[-limit:]


def report(out: Path) -> str:
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").is_file() else ""
    verdicts = ((out / "verdicts.txt").read_text().splitlines()
                if (out / "verdicts.txt").is_file() else [])
    steps_log = (out / "steps.log").read_text() if (out / "steps.log").is_file() else ""
    parts = [f"# llmfast gpu_check, {datetime.date.today()}", "", "```", device, "```", ""]
    for step, command, outcome in _steps(steps_log):
        parts += [f"## {step}: {outcome}", ""]
        if command:
            parts += ["```", command, "```", ""]
        # "PASS     #15 modes: ...", "INFO     #16 profile (sync) ...", "FAIL     serve: ..."
        own = re.compile(rf"^\S+\s+(?:(?:#\d+|all)\s+)?{re.escape(step)}(?:\s*\(|:)")
        mine = [v for v in verdicts if own.match(v)]
        parts += [f"- {v}" for v in mine] + ([""] if mine else [])
        table = _table(step, out / f"{step}.log")
        if table:
            parts += ["```", *table, "```", ""]
        if step == "profile":
            for mode in ("sync", "async"):
                top = out / f"profile-{mode}" / "top_ops.md"
                if top.is_file():
                    text = top.read_text().split("## Top ops")[0].strip()
                    text = text.replace("## Engine phases", "#### Engine phases")
                    parts += [f"{mode}:", "", text, ""]
    # Steps queued behind one skipped for time (gpu_check.sh `queued_after`).
    queued = [v for v in verdicts if v.startswith("QUEUED ")]
    if queued:
        parts += ["## queued for the next call's `skipped`", "", *[f"- {v}" for v in queued], ""]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(report(Path(sys.argv[1])))
