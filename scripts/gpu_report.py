#!/usr/bin/env python3
"""What one scripts/gpu_check.py call measured, as text: report.md (the tree, device,
versions, command and date, then per step its commands, outcome, verdicts and figures),
and the topic pages of profiles/ updated in place.

    python3 scripts/gpu_report.py OUT/gpu_check.json                # report.md to stdout
    python3 scripts/gpu_report.py OUT/gpu_check.json --pages profiles

With --pages the JSON is kept as profiles/gpu/<date>-<device>-<commit>.json (tracked) and
every block `<!-- gpu-check STEP -->` ... `<!-- /gpu-check -->` of profiles/*.md is
rewritten with that step's figures (median, min-max, spread, samples) and verdicts, each
bar verdict quoting the median it was judged on, and the JSON's path.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

BLOCK = re.compile(r"(<!-- gpu-check (\S+) -->\n)(.*?)(<!-- /gpu-check -->)", re.S)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def provenance(result: dict) -> str:
    tree, env = result["tree"], result["environment"]
    commit = tree.get("commit", "unknown")[:10]
    state = ("dirty: " + (tree.get("diff_stat") or "untracked files")
             + f", diff sha256 {str(tree.get('diff_sha256'))[:12]}") if tree.get("dirty") \
        else "clean"
    return (f"{env['device'].splitlines()[0] if env['device'] else 'no device'}; torch "
            f"{env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}; {result['model']} "
            f"{result['dtype']}; tree {commit} ({state}; from {tree.get('source')}); "
            f"{result['date']}; `{result['command']}`")


def figures_table(step: dict) -> list[str]:
    if not step.get("figures"):
        return []
    lines = ["| figure | median | min-max | spread | samples |", "|---|---:|---:|---:|---:|"]
    for name, s in step["figures"].items():
        lines.append(f"| {name} | {_fmt(s['median'])} | {_fmt(s['min'])}-{_fmt(s['max'])} "
                     f"| {100 * s['spread']:.1f}% | {s['n']} |")
    return lines


def step_section(name: str, step: dict) -> list[str]:
    parts = [f"## {name}: {step['status']}", ""]
    for r in step.get("runs", []):
        parts += [f"- `{r['command']}`: rc {r['rc']} in {r['seconds']} s"]
    if step.get("runs"):
        parts.append("")
    parts += [f"- {v['verdict']} {v['text']}" for v in step.get("verdicts", [])]
    if step.get("verdicts"):
        parts.append("")
    outcome = step.get("outcome")
    if outcome and outcome.get("not_reached_files"):
        parts += ["Not reached (run next: `GPU_CHECK_TESTS=\"" + " ".join(
            outcome["not_reached_files"]) + "\" python3 scripts/gpu_check.py tests`)", ""]
    table = figures_table(step)
    return parts + table + ([""] if table else [])


def report(result: dict) -> str:
    parts = [f"# llmfast gpu_check, {result['date'][:10]}", "", provenance(result), ""]
    for name, step in result["steps"].items():
        parts += step_section(name, step)
    return "\n".join(parts) + "\n"


def verdict_lines(result: dict) -> str:
    return "\n".join(f"{v['verdict']:<8} {v['text']}" for s in result["steps"].values()
                     for v in s.get("verdicts", []))


def raw_name(result: dict) -> str:
    device = result["environment"]["device"] or "cpu"
    m = re.search(r"NVIDIA ([A-Za-z0-9]+)", device)
    gpu = m.group(1).lower() if m else "cpu"
    return f"{result['date'][:10]}-{gpu}-{result['tree'].get('commit', 'unknown')[:7]}.json"


def update_pages(result: dict, pages: Path, raw: Path) -> list[Path]:
    """Rewrites every gpu-check block of pages/*.md whose step this result ran."""
    changed = []
    for page in sorted(pages.glob("*.md")):
        text = page.read_text()

        def block(m: re.Match) -> str:
            step = result["steps"].get(m.group(2))
            if step is None or not step.get("runs"):
                return m.group(0)  # not run this time: the page keeps its figures
            body = [f"Measured by `{m.group(2)}`: {provenance(result)}. Raw: "
                    f"`{raw.as_posix()}`.", ""]
            body += [f"- {v['verdict']} {v['text']}" for v in step.get("verdicts", [])]
            body += [""] + figures_table(step)
            return m.group(1) + "\n".join(body).strip() + "\n" + m.group(4)

        new = BLOCK.sub(block, text)
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="gpu_check.json")
    ap.add_argument("--pages", type=Path, help="profiles/: keep the JSON under its gpu/ and "
                                               "update its pages' gpu-check blocks")
    args = ap.parse_args()
    result = json.loads(args.result.read_text())
    if args.pages is None:
        sys.stdout.write(report(result))
        return 0
    raw = args.pages / "gpu" / raw_name(result)
    raw.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.result, raw)
    repo_relative = Path(args.pages.name) / raw.relative_to(args.pages)
    for page in update_pages(result, args.pages, repo_relative):
        print(f"updated {page}")
    print(f"kept {raw} (git add it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
