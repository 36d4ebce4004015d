#!/usr/bin/env python3
"""The figures of scripts/gpu_check.py's steps and the issues' bars over them.

- `figures(step, data)`: one benchmark JSON (as the step's command wrote it) -> one dict
  of named figures per sample it holds (most hold one; bench_kernels.py --samples N and
  bench_serve.py with N `inf` rates hold N), plus pass/fail checks that are not timings
  (every sweep row pure decode, the precompile missed nothing).
- `summarize(samples)`: per figure, the samples, their median, min, max and spread
  ((max - min) / median).
- `judge(step, summary, checks)`: PASS/FAIL lines of the bars, each quoting the median
  and the spread it was judged on; a check FAILs when any sample failed it.
- `pytest_outcome(log)`: a `pytest -m gpu -v -rA` log -> counts, failed ids and the test
  files it never reached (a run cut off by its time limit).
- `report(result)`: what one scripts/gpu_check.py call measured, as text (report.md: the
  tree, device, versions, command and date, then per step its commands, outcome, verdicts
  and figures); `update_pages(result, pages, raw)`: every block
  `<!-- gpu-check STEP -->` ... `<!-- /gpu-check -->` of profiles/*.md rewritten with that
  step's figures (median, min-max, spread, samples) and verdicts, and the JSON's path.

    python3 scripts/gpu_verdicts.py sweep sample1.json sample2.json sample3.json
    python3 scripts/gpu_verdicts.py report OUT/gpu_check.json            # report.md to stdout
    python3 scripts/gpu_verdicts.py report OUT/gpu_check.json --pages profiles

With `report --pages` the JSON is kept as profiles/gpu/<date>-<device>-<commit>.json
(tracked) and the pages' gpu-check blocks are rewritten from it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Figures = dict[str, float]
Checks = list[tuple[bool, str]]


# ------------------------------------------------------------------ figures per step


def _sweep(data: dict) -> list[tuple[Figures, Checks]]:
    run = data["runs"]["default"]
    points = run.get("sweep", [])
    figs: Figures = {}
    for p in points:
        b = p["batch_size"]
        figs[f"B={b} step ms"] = p["step_latency"]["median"] * 1e3
        figs[f"B={b} decode tok/s"] = p["decode_tokens_per_s"]
        if p.get("hbm_fraction") is not None:
            figs[f"B={b} % of HBM"] = 100 * p["hbm_fraction"]
    impure = [p["batch_size"] for p in points if not p["all_decode"]]
    skipped = [s["batch_size"] for s in run.get("sweep_skipped", [])]
    compiled = {p["batch_size"]: p["triton_compiles"] for p in points
                if p.get("triton_compiles")}
    checks = [(bool(points) and not impure and not skipped,
               f"every row pure decode ({len(points)} rows"
               + (f"; not at {impure}" if impure else "")
               + (f"; skipped {skipped}" if skipped else "") + ")"),
              (not compiled, "no Triton kernel compiled after start-up"
               + (f" (at batch: variants {compiled})" if compiled else ""))]
    return [(figs, checks)]


def _modes(data: dict) -> list[tuple[Figures, Checks]]:
    lat = data["latency_ms"]
    figs: Figures = {}
    for mode, by_batch in lat.items():
        for b, ms in by_batch.items():
            figs[f"B={b} {mode} ms"] = ms
    for b in sorted({b for r in lat.values() for b in r}, key=int):
        full, linears, eager = (lat.get(m, {}).get(b) for m in ("full", "linears", "eager"))
        if full and linears:
            figs[f"B={b} full / linears"] = full / linears
        if full and eager:
            figs[f"B={b} eager / full"] = eager / full
    checks = []
    agreement = data.get("agreement") or {}
    for b, by_mode in (agreement.get("by_batch") or {}).items():
        for mode, a in by_mode.items():
            # bf16 rounding moves a 1B model's logits a few % of the largest; a decode
            # reading one context token less moves them 16 %.
            checks.append((a["rel_diff"] <= 0.1, f"B={b} {mode} logits vs "
                           f"{agreement['reference']}: max |diff| {a['rel_diff']:.1e} of "
                           f"the largest (<= 0.1)"))
    return [(figs, checks)]


def _throughput(data: dict) -> list[tuple[Figures, Checks]]:
    run = data["runs"]["default"]
    figs = {"llmfast output tok/s": run["throughput"]["output_tokens_per_s"]}
    if run.get("baseline_hf"):
        figs["HF generate output tok/s"] = run["baseline_hf"]["output_tokens_per_s"]
        figs["llmfast / HF output tok/s"] = run["speedup_vs_hf"]
    compiles = run["throughput"].get("triton_compiles") or {}
    checks = [(not compiles.get("count"), "no Triton kernel compiled inside the timed run")]
    return [(figs, checks)]


def _startup(data: dict) -> list[tuple[Figures, Checks]]:
    report = data["startup"]
    figs: Figures = {}
    for run in ("cold", "warm"):
        figs[f"{run} time to first token s"] = report[run]["time_to_first_token_s"]
        capture = report[run]["stages"].get("capture")
        if capture is not None:
            figs[f"{run} capture s"] = capture
    checks = []
    variants = report["cold"].get("triton_variants")
    if variants is not None:
        checks.append((variants["compiled_at_launch"] == 0
                       and not variants.get("precompile_failed"),
                       f"cold start: {variants['compiled_at_launch']} Triton variants "
                       f"compiled at a launch (precompile missed none)"))
    warm = report["warm"].get("compile_summary") or ""
    if "pieces" in warm:
        checks.append(("loaded without tracing" in warm, "warm start skipped Dynamo"))
    return [(figs, checks)]


def _kernel_sample(data: dict) -> tuple[Figures, Checks]:
    decode, prefill = data["decode"], data.get("prefill", [])
    copy = data["copy_gbs"]
    figs: Figures = {}
    for r in decode:
        row = f"decode B={r['batch']} ctx {r['ctx']}"
        figs[f"{row} llmfast / SDPA speed (eager)"] = r["sdpa_us"] / r["ours_us"]
        if "sdpa_graph_us" in r:  # like for like: both replayed from a CUDA graph
            figs[f"{row} llmfast / SDPA speed (graph)"] = r["sdpa_graph_us"] / r["graph_us"]
        if "graph_us" in r:
            figs[f"{row} llmfast graph us"] = r["graph_us"]
        figs[f"{row} % of copy bandwidth"] = 100 * r["ours_gbs"] / copy
    for r in prefill:
        figs[f"prefill {r['tokens']} llmfast / SDPA speed"] = r["sdpa_us"] / r["ours_us"]
    small = [r for r in decode if r["batch"] <= 8 and 512 <= r["ctx"] <= 8192]
    large = [r for r in decode if r["batch"] >= 64 and r["ctx"] >= 2048]
    long = [r for r in prefill if 2048 <= r["tokens"] <= 8192]
    if small:
        figs["decode B<=8 worst speed vs SDPA (eager)"] = min(
            r["sdpa_us"] / r["ours_us"] for r in small)
        if all("sdpa_graph_us" in r for r in small):
            figs["decode B<=8 worst speed vs SDPA (graph)"] = min(
                r["sdpa_graph_us"] / r["graph_us"] for r in small)
    if large:
        figs["decode B>=64 ctx>=2k worst speed vs SDPA (eager)"] = min(
            r["sdpa_us"] / r["ours_us"] for r in large)
        figs["decode B>=64 ctx>=2k worst fraction of copy bandwidth"] = min(
            r["ours_gbs"] / copy for r in large)
    if long:
        figs["prefill 2k-8k worst speed vs SDPA flash"] = min(
            r["sdpa_us"] / r["ours_us"] for r in long)
    diffs = [r["max_abs_diff"] for r in decode + prefill if "max_abs_diff" in r]
    diffs += [r["fixed_max_abs_diff"] for r in decode if "fixed_max_abs_diff" in r]
    if diffs:
        figs["max abs diff vs SDPA"] = max(diffs)
    uncaptured = [f"B={r['batch']} ctx {r['ctx']}" for r in decode if "sdpa_graph_error" in r]
    checks = [(not uncaptured, "SDPA replayed from a CUDA graph on every decode row"
               + (f" (not at {', '.join(uncaptured)})" if uncaptured else ""))] \
        if any("sdpa_graph_us" in r or "sdpa_graph_error" in r for r in decode) else []
    return figs, checks


def _kernels(data: dict) -> list[tuple[Figures, Checks]]:
    # bench_kernels.py --samples N: N timings of the same rows in one process.
    return [_kernel_sample({**data, **s}) for s in data.get("samples") or [data]]


def _serve(data: dict) -> list[tuple[Figures, Checks]]:
    """bench_serve.py --engine-baseline with the rate `inf` N times: the i-th engine row
    and the i-th server row are sample i (the same prompts, all at once); rows at other
    rates are not samples of these figures."""
    rows = [r for r in data["results"] if r["request_rate"] in ("inf", float("inf"))]
    offline = [r for r in rows if r["what"].startswith("engine")]
    server = [r for r in rows if not r["what"].startswith("engine")]
    samples = []
    for i, s in enumerate(server):
        figs = {"server output tok/s": s["output_tokens_per_s"]}
        if s.get("tpot"):
            figs["server TPOT p50 ms"] = s["tpot"]["median"] * 1e3
        if s.get("ttft"):
            figs["server TTFT p50 ms"] = s["ttft"]["median"] * 1e3
        if i < len(offline):
            figs["offline output tok/s"] = offline[i]["output_tokens_per_s"]
            figs["server / offline output tok/s"] = (s["output_tokens_per_s"]
                                                     / offline[i]["output_tokens_per_s"])
        samples.append((figs, [(s["failed"] == 0, f"every request completed "
                                                  f"({s['completed']}/{s['num_requests']})")]))
    return samples


def _moe(data: dict) -> list[tuple[Figures, Checks]]:
    """bench_moe.py: per shape and token count, the fused layer's time and its ratios."""
    figs: Figures = {}
    checks: Checks = []
    for r in data["rows"]:
        at = f"{r['shape']} T={r['tokens']}"
        figs[f"{at} fused us"] = r["fused_us"]
        figs[f"{at} loop / fused"] = r["loop_over_fused"]
        if r.get("dense_over_fused") is not None:
            figs[f"{at} dense bmm / fused"] = r["dense_over_fused"]
        figs[f"{at} active GB/s"] = r["fused_active_gb_s"]
        err = r["max_abs_error"]["fused"]
        checks.append((err < 0.05, f"{at}: fused within 0.05 of the fp32 loop ({err:.3g})"))
    return [(figs, checks)]


EXTRACT: dict[str, Callable[[dict], list[tuple[Figures, Checks]]]] = {
    "sweep": _sweep, "modes": _modes, "throughput": _throughput, "startup": _startup,
    "kernels": _kernels, "serve": _serve, "moe": _moe,
}


def figures(step: str, data: dict) -> list[tuple[Figures, Checks]]:
    return EXTRACT[step](data)


# ------------------------------------------------------------------ median and spread


def summarize(samples: list[Figures]) -> dict[str, dict]:
    """Per figure (in first-seen order): samples, median, min, max, spread."""
    names: dict[str, None] = {}
    for s in samples:
        names.update(dict.fromkeys(s))
    result = {}
    for name in names:
        values = [s[name] for s in samples if name in s]
        median = statistics.median(values)
        result[name] = dict(samples=values, n=len(values), median=median, min=min(values),
                            max=max(values),
                            spread=(max(values) - min(values)) / median if median else 0.0)
    return result


def merge_checks(per_sample: list[Checks]) -> list[dict]:
    """A check passes when it passed in every sample that made it."""
    merged: dict[str, list[bool]] = {}
    for checks in per_sample:
        for ok, text in checks:
            merged.setdefault(text, []).append(ok)
    return [dict(text=t, ok=all(v), samples=len(v)) for t, v in merged.items()]


# ------------------------------------------------------------------ bars


@dataclass(frozen=True)
class Bar:
    step: str
    figure: str
    at_most: bool
    bar: float
    issue: str


BARS = (
    Bar("modes", "B=1 full / linears", True, 1.25, "#15"),
    Bar("modes", "B=64 full / linears", True, 1.3, "#15"),
    Bar("modes", "B=1 eager / full", False, 6.0, "#15"),
    Bar("kernels", "decode B<=8 worst speed vs SDPA (eager)", False, 1.0, "#17"),
    Bar("kernels", "decode B>=64 ctx>=2k worst speed vs SDPA (eager)", False, 0.9, "#17"),
    Bar("kernels", "decode B>=64 ctx>=2k worst fraction of copy bandwidth", False, 0.8, "#17"),
    Bar("kernels", "prefill 2k-8k worst speed vs SDPA flash", False, 0.8, "#17"),
    Bar("kernels", "max abs diff vs SDPA", True, 4e-3, "#17"),
    Bar("startup", "warm time to first token s", True, 10.0, "#18"),
    Bar("startup", "cold time to first token s", True, 25.0, "#18"),
    Bar("startup", "cold capture s", True, 10.0, "#15"),
    Bar("throughput", "llmfast / HF output tok/s", False, 10.0, "#18"),
    Bar("moe", "qwen3-30b-a3b T=64 loop / fused", False, 5.0, "#52"),
    Bar("moe_decode", "B=1 % of HBM", False, 60.0, "#52"),
    Bar("bw_1b_gemv", "B=1 % of HBM", False, 75.0, "#49"),
    Bar("bw_1b_table", "B=1 % of HBM", False, 75.0, "#49"),
    Bar("bw_8b_gemv", "B=1 % of HBM", False, 85.0, "#49"),
    Bar("bw_8b_table", "B=1 % of HBM", False, 85.0, "#49"),
    Bar("bw_1b_fused", "B=1 % of HBM", False, 75.0, "#49"),
    Bar("bw_8b_fused", "B=1 % of HBM", False, 85.0, "#49"),
    Bar("bw_1b_auto", "B=1 % of HBM", False, 75.0, "#49"),
    Bar("bw_8b_auto", "B=1 % of HBM", False, 85.0, "#49"),
)


@dataclass(frozen=True)
class CrossBar:
    """A bar on two steps' figures, judged once `step` has run: `speedup` is `base`'s
    median over `step`'s at the batch sizes `batches` (the worst of them); at least
    `bar` (`at_most`: at most)."""

    step: str
    base: str
    batches: tuple[int, ...]
    at_most: bool
    bar: float
    issue: str
    what: str


_LARGE = (64, 128, 256, 512)
_DECODE = (1, 2, 4, 8, 16)  # the GEMV's sizes
CROSS_BARS = (
    CrossBar("bw_8b_fp8_gemv", "bw_8b_gemv", (1,), False, 1.6, "#49", "fp8 over bf16 speed"),
    CrossBar("bw_8b_fp8_table", "bw_8b_table", (1,), False, 1.6, "#49", "fp8 over bf16 speed"),
    # The GEMV never runs past 16 rows: batch 64-512 keep their speed (noise: 5 %).
    CrossBar("bw_1b_gemv", "bw_1b_cublas", _LARGE, False, 0.95, "#49", "GEMV-on speed vs off"),
    CrossBar("bw_8b_gemv", "bw_8b_cublas", _LARGE, False, 0.95, "#49", "GEMV-on speed vs off"),
    CrossBar("bw_8b_fp8_gemv", "bw_8b_fp8_cublas", _LARGE, False, 0.95, "#49",
             "GEMV-on speed vs off"),
    CrossBar("bw_8b_fp8_fused", "bw_8b_fused", (1,), False, 1.6, "#49", "fp8 over bf16 speed"),
    # The fused layers run their torch form past 16 rows: what that costs (decides
    # whether --gemv-fuse can be the default).
    CrossBar("bw_1b_fused", "bw_1b_cublas", _LARGE, False, 0.95, "#49", "fused speed vs plain"),
    CrossBar("bw_8b_fused", "bw_8b_cublas", _LARGE, False, 0.95, "#49", "fused speed vs plain"),
    # --gemv auto keeps cuBLAS wherever the start-up measured it faster: no decode size
    # slower than --gemv cublas beyond noise (3 %), batch 64-512 unchanged.
    CrossBar("bw_1b_auto", "bw_1b_cublas", _DECODE, False, 0.97, "#49", "auto speed vs cuBLAS"),
    CrossBar("bw_8b_auto", "bw_8b_cublas", _DECODE, False, 0.97, "#49", "auto speed vs cuBLAS"),
    CrossBar("bw_1b_auto", "bw_1b_cublas", _LARGE, False, 0.95, "#49", "auto speed vs cuBLAS"),
    CrossBar("bw_8b_auto", "bw_8b_cublas", _LARGE, False, 0.95, "#49", "auto speed vs cuBLAS"),
    CrossBar("bw_8b_fp8_auto", "bw_8b_auto", (1,), False, 1.6, "#49", "fp8 over bf16 speed"),
)


def judge_cross(step: str, steps: dict[str, dict]) -> list[dict]:
    """The cross-step bars of `step` against the steps already run (`steps`: name ->
    its record with `figures`), plus the batch-1 speedup over the base as information."""
    lines = []
    for bar in (b for b in CROSS_BARS if b.step == step):
        mine = (steps.get(step) or {}).get("figures") or {}
        base = (steps.get(bar.base) or {}).get("figures") or {}
        ratios = {b: base[f"B={b} step ms"]["median"] / mine[f"B={b} step ms"]["median"]
                  for b in bar.batches
                  if f"B={b} step ms" in mine and f"B={b} step ms" in base}
        sign = "<=" if bar.at_most else ">="
        if bar.base not in steps:  # (another call's step: not judged here)
            lines.append(dict(verdict="SKIPPED", text=f"{bar.issue} {step}: {bar.what} "
                              f"against {bar.base}: {bar.base} not run in this call"))
            continue
        if not ratios:
            lines.append(dict(verdict="MISSING", text=f"{bar.issue} {step}: {bar.what} "
                              f"against {bar.base}: not measured (bar {sign} {bar.bar:g})"))
            continue
        worst_b = (max if bar.at_most else min)(ratios, key=ratios.get)
        worst = ratios[worst_b]
        ok = worst <= bar.bar if bar.at_most else worst >= bar.bar
        lines.append(dict(verdict="PASS" if ok else "FAIL",
                          text=f"{bar.issue} {step}: {bar.what} against {bar.base} "
                               f"(step ms ratio, worst at B={worst_b} of "
                               f"{','.join(map(str, ratios))}): {_fmt(worst)} "
                               f"(bar {sign} {bar.bar:g})"))
    return lines


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def quote(s: dict) -> str:
    """`median 1.19 of 3 (1.18-1.21, spread 2.5%)`."""
    return (f"median {_fmt(s['median'])} of {s['n']} ({_fmt(s['min'])}-{_fmt(s['max'])}, "
            f"spread {100 * s['spread']:.1f}%)")


def judge(step: str, summary: dict[str, dict], checks: list[dict]) -> list[dict]:
    """The step's verdicts: {verdict, text} with verdict PASS, FAIL or MISSING."""
    lines = []
    for bar in (b for b in BARS if b.step == step):
        sign = "<=" if bar.at_most else ">="
        s = summary.get(bar.figure)
        if s is None:
            lines.append(dict(verdict="MISSING", text=f"{bar.issue} {step}: {bar.figure}: not "
                                                      f"measured (bar {sign} {bar.bar:g})"))
            continue
        ok = s["median"] <= bar.bar if bar.at_most else s["median"] >= bar.bar
        lines.append(dict(verdict="PASS" if ok else "FAIL",
                          text=f"{bar.issue} {step}: {bar.figure}: {quote(s)} "
                               f"(bar {sign} {bar.bar:g})"))
    for c in checks:
        lines.append(dict(verdict="PASS" if c["ok"] else "FAIL",
                          text=f"{step}: {c['text']} (in {c['samples']} of "
                               f"{c['samples']} samples)" if c["ok"] else
                          f"{step}: {c['text']} (failed in a sample)"))
    return lines


# ------------------------------------------------------------------ pytest logs

_SUMMARY_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(tests/\S+::\S+)")
_VERBOSE_ID = re.compile(r"^(tests/\S+::\S+)")
# An outcome ends the test's id line or stands on a line of its own (with -s the test's
# prints come between); a test's own print ending in "PASSED" is not one, unless it
# carries pytest's progress percentage.
_WORDS = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
_VERBOSE_OUTCOME = re.compile(rf"\b{_WORDS}\s+\[\s*\d+%\]\s*$|^{_WORDS}\s*$")
_ID_OUTCOME = re.compile(rf"^tests/\S+::\S+ {_WORDS}\s*$")
_TOTALS = re.compile(r"=+ (.*\d+ (?:passed|failed|error|errors|skipped|deselected).*) "
                     r"in [\d.]+s")
_COLLECTED = re.compile(r"^(tests/[^:\s]+)::")


def pytest_outcome(log: str, collected: list[str] | None = None) -> dict:
    """Outcome per test from `pytest -v -rA` (the -rA summary wins over the progress
    lines; a run cut off by its time limit has only those), the totals line if pytest
    got to print it, and the collected test files (`collected`, from --collect-only -q)
    of which no test finished."""
    by_test: dict[str, str] = {}
    current = None
    for line in log.splitlines():
        m = _VERBOSE_ID.match(line)
        if m:
            current = m.group(1)
        m = _VERBOSE_OUTCOME.search(line) or _ID_OUTCOME.match(line)
        if m and current is not None:
            by_test[current] = next(g for g in m.groups() if g)
            current = None
    for line in log.splitlines():
        m = _SUMMARY_OUTCOME.match(line)
        if m:
            by_test[m.group(2)] = m.group(1)
    counts: dict[str, int] = {}
    for outcome in by_test.values():
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    totals = _TOTALS.findall(log)
    reached = {t.split("::")[0] for t in by_test}
    files = list(dict.fromkeys(_COLLECTED.match(t).group(1) for t in collected or []
                               if _COLLECTED.match(t)))
    return dict(totals=totals[-1] if totals else None, counts=counts, collected=len(files and
                collected or []),
                failed=sorted(t for t, o in by_test.items() if o in ("FAILED", "ERROR")),
                not_reached_files=[f for f in files if f not in reached])


def judge_tests(outcome: dict, dry_run: bool = False) -> list[dict]:
    if dry_run:  # --collect-only: the files import
        return [dict(verdict="PASS" if outcome["totals"] or outcome["collected"] else "FAIL",
                     text=f"tests: {outcome['collected']} gpu tests collected")]
    lines = []
    if outcome["totals"] is None:
        lines.append(dict(verdict="FAIL", text="tests: pytest printed no result line (cut off "
                          "or crashed); not reached: "
                          + (" ".join(outcome["not_reached_files"]) or "-")))
    else:
        lines.append(dict(verdict="PASS" if not outcome["failed"] else "FAIL",
                          text=f"tests: pytest -m gpu: {outcome['totals']}"))
    lines += [dict(verdict="FAIL", text=f"tests: {t}") for t in outcome["failed"]]
    return lines


# ------------------------------------------------------------------ report and pages

BLOCK = re.compile(r"(<!-- gpu-check (\S+) -->\n)(.*?)(<!-- /gpu-check -->)", re.S)


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


def _judge_samples(step: str, paths: list[Path]) -> None:
    samples = [s for p in paths for s in figures(step, json.loads(p.read_text()))]
    summary = summarize([f for f, _ in samples])
    for line in judge(step, summary, merge_checks([c for _, c in samples])):
        print(f"{line['verdict']:<8} {line['text']}")
    for name, s in summary.items():
        print(f"{name}: {quote(s)}")


def _report(result_path: Path, pages: Path | None) -> None:
    result = json.loads(result_path.read_text())
    if pages is None:
        sys.stdout.write(report(result))
        return
    raw = pages / "gpu" / raw_name(result)
    raw.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(result_path, raw)
    repo_relative = Path(pages.name) / raw.relative_to(pages)
    for page in update_pages(result, pages, repo_relative):
        print(f"updated {page}")
    print(f"kept {raw} (git add it)")


def main() -> int:
    if sys.argv[1:2] == ["report"]:
        ap = argparse.ArgumentParser(prog="gpu_verdicts.py report",
                                     description="report.md of one gpu_check.json, or the "
                                                 "pages updated from it")
        ap.add_argument("result", type=Path, help="gpu_check.json")
        ap.add_argument("--pages", type=Path, help="profiles/: keep the JSON under its gpu/ "
                                                   "and update its pages' gpu-check blocks")
        args = ap.parse_args(sys.argv[2:])
        _report(args.result, args.pages)
        return 0
    ap = argparse.ArgumentParser(description="one step's samples judged against its bars")
    ap.add_argument("step", choices=sorted(EXTRACT))
    ap.add_argument("samples", type=Path, nargs="+", help="the step's benchmark JSON files")
    args = ap.parse_args()
    _judge_samples(args.step, args.samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
