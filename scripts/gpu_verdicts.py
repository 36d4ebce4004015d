#!/usr/bin/env python3
"""PASS/FAIL lines for one step of scripts/gpu_check.sh, against the open issues' bars,
from what the step left under $OUT (its JSON, or its pytest log).

    python3 scripts/gpu_verdicts.py modes /tmp/llmfast_gpu_check
    python3 scripts/gpu_verdicts.py --dry-run startup /tmp/llmfast_gpu_check_dry

Every line starts with PASS, FAIL, INFO or MISSING (the step left nothing to judge),
then the issue and what was compared: `PASS #15 modes: B=1 full / linears = 1.18 (bar
<= 1.25)`. With --dry-run (gpu_check.sh's CPU rehearsal) PASS/FAIL become DRY-PASS /
DRY-FAIL: the figures are CPU ones and only show that the parsing works.
A step without bars (serve, defaults, presets, families) prints nothing here.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

Line = tuple[str, str]  # (verdict, text)


def info(text: str) -> Line:
    return ("INFO", text)


def check(ok: bool, text: str) -> Line:
    return ("PASS" if ok else "FAIL", text)


def _load(out: Path, name: str) -> dict | None:
    path = out / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def _ratio_line(issue: str, label: str, value: float | None, bar: float,
                at_most: bool = True) -> Line:
    sign = "<=" if at_most else ">="
    if value is None:
        return ("MISSING", f"{issue} {label}: not measured (bar {sign} {bar:g})")
    ok = value <= bar if at_most else value >= bar
    return check(ok, f"{issue} {label} = {value:.2f} (bar {sign} {bar:g})")


# ---------------------------------------------------------------------- JSON steps


def modes(out: Path) -> Iterator[Line]:
    """#15: full <= 1.25x linears at B=1, <= 1.3x at B=64; full >= 6x eager at B=1."""
    data = _load(out, "modes.json")
    if data is None:
        yield ("MISSING", "#15 modes: no modes.json")
        return
    lat = data["latency_ms"]

    def ms(mode: str, batch: int) -> float | None:
        return lat.get(mode, {}).get(str(batch))

    yield from _full_over_linears(lat, "modes")
    full, eager = ms("full", 1), ms("eager", 1)
    yield _ratio_line("#15", "modes: B=1 eager / full (speed-up)",
                      eager / full if full and eager else None, 6.0, at_most=False)
    for batch in sorted({int(b) for r in lat.values() for b in r}):
        row = ", ".join(f"{m} {lat[m][str(batch)]:.3f}" for m in lat if str(batch) in lat[m])
        yield info(f"#15 modes: B={batch} ms: {row}")
    yield from _modes_agreement(data.get("agreement"))


def _full_over_linears(lat: dict, step: str) -> Iterator[Line]:
    """#15's bars on a bench_modes latency table: full <= 1.25x linears at B=1, <= 1.3x
    at B=64."""
    for batch, bar in ((1, 1.25), (64, 1.3)):
        full, floor = lat.get("full", {}).get(str(batch)), lat.get("linears", {}).get(str(batch))
        yield _ratio_line("#15", f"{step}: B={batch} full / linears",
                          full / floor if full and floor else None, bar)


def diag(out: Path) -> Iterator[Line]:
    """#15 again from `diag` (full + linears only), and what its kernel traces show: the
    step's kernel time and whether the norms and RoPE ran as llmfast's Triton kernels
    (RoPE in the attention op's KV write: `_rope_and_cache_kernel`, no rotary kernel;
    in a uniform decode step inside the attention: `_decode_rope_attention_kernel`)."""
    data = _load(out, "diag_modes.json")
    if data is None:
        yield ("MISSING", "#15 diag: no diag_modes.json")
        return
    yield from _full_over_linears(data["latency_ms"], "diag")
    for trace in sorted((out / "traces").glob("full_B*_kernels.md")):
        text = trace.read_text()
        head = text.splitlines()[0].lstrip("# ") if text else ""
        kernels = {name: text.count(f"`{name}") for name in
                   ("rms_norm_kernel", "_decode_rope_attention_kernel",
                    "_rope_and_cache_kernel", "rotary_kernel", "_reshape_and_cache_kernel",
                    "memcpy32_post", "triton_red_fused", "direct_copy_kernel")}
        yield info(f"#15 diag: {head}; layer kernels in the trace: "
                   + ", ".join(f"{k} {'yes' if n else 'no'}" for k, n in kernels.items()))


# bf16 rounding moves a 1B model's logits by a few % of the largest (compiled vs eager,
# measured on the CPU: 3 %); a decode that reads one context token less moves them 16 %.
MODES_MAX_REL_DIFF = 0.1


def _modes_agreement(agreement: dict | None, label: str = "#15 modes",
                     file: str = "modes.json") -> Iterator[Line]:
    """#15 correctness riding on the timing run: every mode's logits vs eager's."""
    if not agreement or not agreement.get("by_batch"):
        yield ("MISSING", f"{label}: no logits agreement in {file}")
        return
    ref = agreement["reference"]
    for batch, by_mode in agreement["by_batch"].items():
        for mode, a in by_mode.items():
            yield check(a["rel_diff"] <= MODES_MAX_REL_DIFF,
                        f"{label}: B={batch} {mode} logits vs {ref}: max |diff| "
                        f"{a['rel_diff']:.1e} of the largest (bar <= {MODES_MAX_REL_DIFF:g}), "
                        f"argmax agrees on {a['argmax_agree']:.0%} of rows")


def async_bench(out: Path) -> Iterator[Line]:
    """#16: end-to-end async step <= 1.10x the model step at 1 and 64, <= 1.05x at 256."""
    data = _load(out, "async.json")
    if data is None:
        yield ("MISSING", "#16 async: no async.json")
        return
    bars = {1: 1.10, 64: 1.10, 256: 1.05}
    for row in data["rows"]:
        if "skipped" in row:
            yield ("MISSING", f"#16 async: B={row['batch']} not measured: {row['skipped']}")
            continue
        batch, model = row["batch"], row["model_step_ms"]
        bar = bars.get(batch)
        if bar is not None:
            yield _ratio_line("#16", f"async: B={batch} async step / model step",
                              row["async_ms"] / model, bar)
        yield info(f"#16 async: B={batch} model {model:.2f} ms, sync {row['sync_ms']:.2f}"
                       f" ms, async {row['async_ms']:.2f} ms (async / sync "
                       f"{row['async_ms'] / row['sync_ms']:.3f})")


def load(out: Path) -> Iterator[Line]:
    """#18: random 1B init <= 2 s; safetensors load >= 50 % of the disk's read speed."""
    data = _load(out, "load.json")
    if data is None:
        yield ("MISSING", "#18 load: no load.json")
        return
    yield _ratio_line("#18", f"load: random init of {data['preset']} (s)",
                      data.get("random_init_new_s"), 2.0)
    if "first_use_s" in data:  # bench_load times them apart: not in the init above
        yield info(f"#18 load: process first-use costs {data['first_use_s']:.2f} s (first "
                   f"tensor on the device {data['first_use_device_s']:.2f} s, first "
                   f"build_model {data['first_use_build_s']:.2f} s), outside the init")
    for cache in ("cold", "warm"):
        share = data.get(f"{cache}_load_vs_read")
        line = _ratio_line("#18", f"load: safetensors {cache} load / disk read speed",
                           share, 0.5, at_most=False)
        if cache == "cold" and data.get("cold_note"):
            # The "disk" read came from memory (tmpfs, or the page cache kept the file):
            # no disk speed to judge against.
            yield ("MISSING", f"#18 load: disk speed not measured ({data['cold_note']}); "
                              f"{line[1]}")
            continue
        yield line if cache == "cold" else info(line[1])


def startup(out: Path) -> Iterator[Line]:
    """#18: time to first token warm <= 10 s, cold <= 25 s; #15: capture <= 10 s."""
    data = _load(out, "startup.json")
    if data is None or "startup" not in data:
        yield ("MISSING", "#18 startup: no startup.json")
        return
    report = data["startup"]
    for run, bar in (("warm", 10.0), ("cold", 25.0)):
        yield _ratio_line("#18", f"startup: {run} time to first token (s)",
                          report[run]["time_to_first_token_s"], bar)
    for run in ("cold", "warm"):
        stages = report[run]["stages"]
        yield _ratio_line("#15", f"startup: {run} capture of the default sizes (s)",
                          stages.get("capture"), 10.0)
        summary = report[run].get("compile_summary")
        yield info(f"#18 startup: {run} stages "
                       + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items())
                       + (f"; {summary}" if summary else ""))
    prime_s = report.get("bytecode_prime_s")
    if prime_s is not None:  # llmfast/bench/startup/bytecode_prime.py
        modules = report.get("bytecode_primed_modules") or 0
        yield info(f"#18 startup: no bytecode installed; priming llmfast's bytecode cache "
                   f"before the cold start took {prime_s:.2f} s and compiled {modules} "
                   f"modules (a machine's very first start: cold + that)")
    variants = report["cold"].get("triton_variants")
    if variants is not None:  # llmfast/worker/startup/kernel_precompile.py
        # A variant compiled at its launch: one the dry forwards missed (their batches
        # need another kind), on the start's critical path again.
        failed = " (the precompile raised: a warning in the log)" if variants.get(
            "precompile_failed") else ""
        yield check(variants["compiled_at_launch"] == 0 and not failed,
                    f"#18 startup: cold start compiled {variants['precompiled']} Triton "
                    f"variants in threads, {variants['compiled_at_launch']} at a "
                    f"launch{failed}")
    warm_summary = report["warm"].get("compile_summary") or ""
    if "pieces" in warm_summary:  # a compiled start (not --enforce-eager)
        # llmfast/compile/precompiled.py: the warm start loads the cold one's trace.
        yield check("loaded without tracing" in warm_summary,
                    "#18 startup: the warm start skipped Dynamo (precompiled model loaded)")


def startup_thin(out: Path) -> Iterator[Line]:
    """#18 with fewer piecewise graphs (--piecewise-graph-sizes): the same start-up
    figures, informational (the default sizes are what the bars are about)."""
    data = _load(out, "startup_thin.json")
    if data is None or "startup" not in data:
        yield ("MISSING", "#18 startup_thin: no startup_thin.json")
        return
    report = data["startup"]
    for run in ("cold", "warm"):
        stages = report[run]["stages"]
        summary = report[run].get("compile_summary")
        yield info(f"#18 startup_thin: {run} time to first token "
                   f"{report[run]['time_to_first_token_s']:.2f} s; stages "
                   + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items())
                   + (f"; {summary}" if summary else ""))


def startup_serial(out: Path) -> Iterator[Line]:
    """#18: the cold start with the Triton variants compiled at their launches and
    Inductor's compile workers started at its first kernel (LLMFAST_KERNEL_PRECOMPILE=0
    TORCH_WARM_POOL=0: as before 2026-11-26's session 19), against `startup`'s cold
    start on the same machine: what the two save. Informational."""
    data, default = _load(out, "startup_serial.json"), _load(out, "startup.json")
    if data is None or "startup" not in data:
        yield ("MISSING", "#18 startup_serial: no startup_serial.json")
        return
    serial = data["startup"]["cold"]
    line = (f"#18 startup_serial: cold time to first token {serial['time_to_first_token_s']:.2f}"
            " s with compiles serial; stages "
            + ", ".join(f"{k} {v:.2f} s" for k, v in serial["stages"].items()))
    if default is not None and "startup" in default:
        cold = default["startup"]["cold"]
        line += (f"; startup's cold start (precompile, early workers) "
                 f"{cold['time_to_first_token_s']:.2f} s: "
                 f"{serial['time_to_first_token_s'] - cold['time_to_first_token_s']:+.2f} s "
                 "saved")
    yield info(line)


def sweep(out: Path) -> Iterator[Line]:
    """#18: every reported row is pure decode; tok/s per row; % of HBM on CUDA."""
    data = _load(out, "sweep.json")
    if data is None:
        yield ("MISSING", "#18 sweep: no sweep.json")
        return
    for name, run in data["runs"].items():
        points = run.get("sweep", [])
        impure = [p["batch_size"] for p in points if not p["all_decode"]]
        yield check(bool(points) and not impure,
                    f"#18 sweep ({name}): {len(points)} rows, all pure decode"
                    + (f" except batch {impure}" if impure else ""))
        # A skipped size is a row the sweep could not report as pure decode: the issue
        # asks for every requested size.
        for skip in run.get("sweep_skipped", []):
            yield check(False, f"#18 sweep ({name}): batch {skip['batch_size']} skipped: "
                               f"{skip['reason']}")
        wanted = data.get("config", {}).get("sizes")
        if wanted is not None:
            missing = sorted(set(wanted) - {p["batch_size"] for p in points})
            yield check(not missing, f"#18 sweep ({name}): a row for each of the "
                        f"{len(wanted)} requested sizes"
                        + (f" (none for {missing})" if missing else ""))
        on_cuda = str(run["engine_config"]["device"]).startswith("cuda")
        if on_cuda:
            missing = [p["batch_size"] for p in points if p.get("hbm_fraction") is None]
            yield check(not missing, f"#18 sweep ({name}): % of HBM bandwidth on every row"
                        + (f" (missing at {missing})" if missing else ""))
        if points and "triton_compiles" in points[0]:
            compiled = {p["batch_size"]: p["triton_compiles"] for p in points
                        if p["triton_compiles"]}
            yield check(not compiled, f"#18 sweep ({name}): no Triton kernel compiled after "
                        "start-up" + (f" (at batch: variants {compiled})" if compiled else ""))
        for p in points:
            hbm = p.get("hbm_fraction")
            yield info(f"#18 sweep ({name}): B={p['batch_size']} "
                           f"{p['step_latency']['median'] * 1e3:.2f} ms, "
                           f"{p['decode_tokens_per_s']:.0f} tok/s"
                           + (f", {100 * hbm:.0f}% of HBM" if hbm is not None else ""))


def _worst(rows: list[dict], value: Callable[[dict], float], what: str, issue: str,
           bar: float, at_most: bool = False) -> Line:
    """One line for the row that does worst against `bar` (named in the line)."""
    sign = "<=" if at_most else ">="
    if not rows:
        return ("MISSING", f"{issue} {what}: no such rows (bar {sign} {bar:g})")
    worst = (max if at_most else min)(rows, key=value)
    v = value(worst)
    where = ", ".join(f"{k} {worst[k]}" for k in ("batch", "ctx", "tokens", "chunk", "decodes")
                      if k in worst)
    return check(v <= bar if at_most else v >= bar,
                 f"{issue} {what}: worst {v:.3g} at {where} over {len(rows)} rows "
                 f"(bar {sign} {bar:g})")


def kernels(out: Path) -> Iterator[Line]:
    """#17: decode >= 1.0x SDPA at B=1..8, contexts 512-8k (eager launch); >= 0.9x SDPA
    and >= 80 % of copy bandwidth at B >= 64, context >= 2k; prefill >= 0.8x SDPA at
    2k-8k causal; max abs diff vs SDPA <= 4e-3 everywhere; a mixed batch not slower than
    its two parts."""
    data = _load(out, "kernels.json")
    if data is None:
        yield ("MISSING", "#17 kernels: no kernels.json")
        return
    yield from _kernel_lines(data, "#17 kernels:")


def kernels_table(out: Path) -> Iterator[Line]:
    """#17's decode bars again from `kernels_table` (decode rows only, run after the
    call's split sweeps were installed: the table that will ship)."""
    data = _load(out, "kernels_table.json")
    if data is None:
        yield ("MISSING", "#17 kernels_table: no kernels_table.json")
        return
    yield from _kernel_lines(data, "#17 kernels_table (this call's split table):",
                             decode_only=True)


def _kernel_lines(data: dict, label: str, decode_only: bool = False) -> Iterator[Line]:
    decode, prefill, mixed = data["decode"], data["prefill"], data["mixed"]
    speed = lambda r: r["sdpa_us"] / r["ours_us"]  # noqa: E731 - >1: faster than SDPA
    small = [r for r in decode if r["batch"] <= 8 and 512 <= r["ctx"] <= 8192]
    yield _worst(small, speed, "decode B<=8 speed vs SDPA (eager)", label, 1.0)
    large = [r for r in decode if r["batch"] >= 64 and r["ctx"] >= 2048]
    yield _worst(large, speed, "decode B>=64 ctx>=2k speed vs SDPA (eager)", label, 0.9)
    yield _worst(large, lambda r: r["ours_gbs"] / data["copy_gbs"],
                 "decode B>=64 ctx>=2k fraction of copy bandwidth", label, 0.8)
    long = [r for r in prefill if 2048 <= r["tokens"] <= 8192]
    if not decode_only:
        yield _worst(long, speed, "prefill 2k-8k causal speed vs SDPA flash", label, 0.8)
    diffs = ([r for r in decode + prefill if "max_abs_diff" in r]
             + [dict(r, max_abs_diff=r["fixed_max_abs_diff"]) for r in decode
                if "fixed_max_abs_diff" in r])
    yield _worst(diffs, lambda r: r["max_abs_diff"], "max abs diff vs SDPA", label, 4e-3,
                 at_most=True)
    ulps = [r for r in prefill if "max_diff_ulps" in r]
    if ulps:  # to read a FAIL above: a unit or two in the last place is rounding
        worst = max(ulps, key=lambda r: r["max_diff_ulps"])
        yield info(f"#17 prefill max diff vs SDPA in units of the last place: "
                   f"{worst['max_diff_ulps']:.1f} at {worst['tokens']} tokens")
    if not decode_only:
        yield _worst(mixed, lambda r: r["mixed_us"] / r["parts_us"],
                     "mixed batch time / its two parts' time", label, 1.0, at_most=True)
    for r in small + large:
        yield info(f"{label} decode B={r['batch']} ctx {r['ctx']}: {r['ours_us']:.1f} us vs SDPA "
                   f"{r['sdpa_us']:.1f} us ({speed(r):.2f}x), "
                   f"{100 * r['ours_gbs'] / data['copy_gbs']:.0f}% of copy bandwidth")
    hosts = [r for r in decode if "launch_host_tensors_us" in r]
    if hosts:  # what handing the launcher addresses saved of an eager launch's host time
        yield info(f"{label} host us per launch, addresses / tensors to the launcher: " + ", ".join(
            f"B={r['batch']} ctx {r['ctx']} {r['launch_host_us']:.1f} / "
            f"{r['launch_host_tensors_us']:.1f}" for r in hosts))


def fp8_modes(out: Path) -> Iterator[Line]:
    """--quantization fp8 (no issue's bar): the full-graph decode step against bf16's on
    the same machine, and fp8's own logits agreement between modes."""
    fp8, bf16 = _load(out, "modes_fp8.json"), _load(out, "modes_bf16.json")
    if fp8 is None or bf16 is None:
        yield ("MISSING", "fp8 modes: no modes_fp8.json / modes_bf16.json")
        return
    for batch, ms in fp8["latency_ms"].get("full", {}).items():
        base = bf16["latency_ms"].get("full", {}).get(batch)
        if base:
            yield info(f"fp8 modes: B={batch} full-graph step {ms:.3f} ms vs bf16 {base:.3f} "
                       f"ms ({base / ms:.2f}x)")
    yield from _modes_agreement(fp8.get("agreement"), "fp8 modes", "modes_fp8.json")


def kvfp8_kernels(out: Path) -> Iterator[Line]:
    """--kv-cache-dtype fp8 (no issue's bar): decode over an fp8 cache against SDPA in
    bf16, and its bandwidth at one byte per cache element; max diff against SDPA on the
    same fp8-rounded values (#17's 4e-3 applies: only the kernel differs)."""
    data = _load(out, "kernels_kvfp8.json")
    if data is None:
        yield ("MISSING", "kvfp8 kernels: no kernels_kvfp8.json")
        return
    decode = data["decode"]
    yield _worst(decode, lambda r: r["max_abs_diff"], "max abs diff vs SDPA", "kvfp8", 4e-3,
                 at_most=True)
    for r in decode:
        yield info(f"kvfp8 decode B={r['batch']} ctx {r['ctx']}: {r['ours_us']:.1f} us vs "
                   f"SDPA bf16 {r['sdpa_us']:.1f} us ({r['sdpa_us'] / r['ours_us']:.2f}x), "
                   f"{100 * r['ours_gbs'] / data['copy_gbs']:.0f}% of copy bandwidth")


def throughput(out: Path) -> Iterator[Line]:
    """#18: offline output tok/s >= 10x HF generate (HF batch size tuned, stated)."""
    data = _load(out, "throughput.json")
    if data is None:
        yield ("MISSING", "#18 throughput: no throughput.json")
        return
    run = data["runs"]["default"]
    yield _ratio_line("#18", "throughput: llmfast / HF generate, output tok/s",
                      run.get("speedup_vs_hf"), 10.0, at_most=False)
    if "throughput" in run:
        t = run["throughput"]
        hf = run.get("baseline_hf", {})
        yield info(f"#18 throughput: llmfast {t['output_tokens_per_s']:.0f} output / "
                       f"{t['total_tokens_per_s']:.0f} total tok/s; HF at batch "
                       f"{run.get('hf_batch_size')}: {hf.get('output_tokens_per_s', 0):.0f} / "
                       f"{hf.get('total_tokens_per_s', 0):.0f}; total speed-up "
                       f"{run.get('total_speedup_vs_hf', float('nan')):.2f}")
        compiles = t.get("triton_compiles")
        if compiles and compiles.get("watched"):
            yield ("PASS" if compiles["count"] == 0 else "FAIL",
                   f"#18 throughput: Triton kernels compiled inside the timed run = "
                   f"{compiles['count']} ({compiles['seconds']:.1f} s: "
                   f"{compiles['by_kernel']}) (bar == 0: start-up compiles every variant)")


def defaults(out: Path, step: str) -> Iterator[Line]:
    """#18: the CUDA step limits' default decided by measurement. Each `defaults_<budget>`
    step is an offline throughput run (512 prompts, max_num_seqs 512) at one token budget,
    `defaults_default` at the engine's own; once the default and another are in, the
    default must come within 5 % of the best budget measured."""
    data = _load(out, f"{step}.json")
    if data is None:
        yield ("MISSING", f"#18 {step}: no {step}.json")
        return
    measured: dict[str, tuple[float, int | None]] = {}  # budget name -> (tok/s, tokens)
    for path in sorted(out.glob("defaults_*.json")):
        run = json.loads(path.read_text())["runs"]["default"]
        tokens = ((run.get("engine_config") or {}).get("scheduler") or {}).get(
            "max_num_batched_tokens")
        measured[path.stem.removeprefix("defaults_")] = (
            run["throughput"]["output_tokens_per_s"], tokens)
    name = step.removeprefix("defaults_")
    tok_s, tokens = measured[name]
    yield info(f"#18 {step}: token budget {tokens}: {tok_s:.0f} output tok/s")
    if "default" in measured and len(measured) > 1:
        # Judged again after each budget: the best so far only grows, so the last line
        # of a call is the verdict (an earlier PASS may turn into a FAIL, never back).
        best = max(measured, key=lambda b: measured[b][0])
        default_tok_s, default_tokens = measured["default"]
        ratio = default_tok_s / measured[best][0]
        yield check(ratio >= 0.95,
                    f"#18 {step}: the default budget ({default_tokens} tokens) gives "
                    f"{ratio:.2f}x the output tok/s of the best of {len(measured)} measured "
                    f"so far ({measured[best][1]} tokens: {measured[best][0]:.0f}) "
                    f"(bar >= 0.95)")


def profile(out: Path) -> Iterator[Line]:
    """#16: the phase table has device time under CUDA graphs, and overlap when async."""
    for mode in ("sync", "async"):
        data = _load(out / f"profile-{mode}", "summary.json")
        if data is None:
            yield ("MISSING", f"#16 profile ({mode}): no profile-{mode}/summary.json")
            continue
        phases = data.get("phases", {})
        forward = phases.get("forward", {})
        device_ms = forward.get("device_ms")
        yield check(bool(device_ms) and device_ms > 0,
                    f"#16 profile ({mode}): forward device time {device_ms} ms in total "
                    "(CUDA events; was 0.00 under CUDA graphs)")
        rows = []
        for name, p in phases.items():
            calls = max(p["count"], 1)
            dev = "-" if p.get("device_ms") is None else f"{p['device_ms'] / calls:.3f}"
            overlap = ("-" if p.get("overlap_ms") is None
                       else f"{100 * p['overlap_ms'] / max(p['host_ms'], 1e-9):.0f}%")
            rows.append(f"{name} host {p['host_ms'] / calls:.3f} dev {dev} ovl {overlap}")
        yield info(f"#16 profile ({mode}) per call ms: " + "; ".join(rows))


# ---------------------------------------------------------------------- pytest steps

_PYTEST_KEY_TESTS = {
    "full": ("#15", ("test_greedy_tokens_identical_in_every_mode_and_equal_hf",
                     "test_seeded_sampling_identical_in_every_mode",
                     "test_capture_counts_per_mode",
                     "test_default_sizes_both_kinds_capture_on_llama_1b")),
    "async_tests": ("#16", ("test_steady_state_steps_never_sync",
                            "test_async_outputs_equal_sync_on_cuda",
                            "test_phase_timer_shows_device_time_under_cuda_graphs",
                            "test_cuda_no_sync_and_seeded_tokens_match_cpu",
                            "test_prompt_logprobs_steps_never_sync")),
    "fp8": ("fp8", ("test_scaled_mm_layer_matches_float64_fake_quant",
                    "test_1b_fp8_generates_close_to_bf16")),
    "kvfp8": ("kvfp8", ("test_decode_attention", "test_decode_attention_forced_splits",
                        "test_prefill_attention",
                        "test_1b_fp8_cache_generates_close_to_bf16_cache")),
    "tests": ("all", ()),
    "families": ("#19", ()),
}
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)")
_TOTALS = re.compile(r"=+ (.*\d+ (?:passed|failed|error|errors|skipped).*) in [\d.]+s")
_CAPTURE = re.compile(r"llama-3\.2-1b default mode: .*?(\d+) piecewise CUDA graphs at (\d+) "
                      r"sizes, (\d+) full graphs, in ([\d.]+) s, (\d+) MiB")


_VERBOSE_ID = re.compile(r"^(tests/\S+::\S+)")
# The progress percentage is required: a test's own print ending in "PASSED" is not an
# outcome.
_VERBOSE_OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED)\s+\[\s*\d+%\]\s*$")


def _outcomes(text: str) -> dict[str, str]:
    """Test id -> outcome, from pytest -v's progress lines (`id PASSED [ 14%]`; with -s
    the test's prints come between the id and the outcome) and the -rA summary
    (`PASSED id`), which wins when present: a run cut off by its time limit has only
    the former."""
    result: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = _VERBOSE_ID.match(line)
        if m:
            current = m.group(1)
        m = _VERBOSE_OUTCOME.search(line)
        if m and current is not None:
            result[current] = m.group(1)
            current = None
    for line in text.splitlines():
        m = _OUTCOME.match(line)
        if m and "::" in m.group(2):
            result[m.group(2)] = m.group(1)
    return result


def pytest_step(step: str, out: Path) -> Iterator[Line]:
    log = out / f"{step}.log"
    issue, key_tests = _PYTEST_KEY_TESTS[step]
    if not log.is_file():
        yield ("MISSING", f"{issue} {step}: no {step}.log")
        return
    text = log.read_text(errors="replace")
    by_test = _outcomes(text)
    outcomes: dict[str, list[str]] = {}
    for test_id, outcome in by_test.items():
        outcomes.setdefault(outcome, []).append(test_id)
    totals = _TOTALS.findall(text)
    if not totals:
        yield ("FAIL", f"{issue} {step}: pytest printed no result line (crashed or timed out)")
    else:
        bad = outcomes.get("FAILED", []) + outcomes.get("ERROR", [])
        yield check(not bad and "failed" not in totals[-1] and "error" not in totals[-1],
                    f"{issue} {step}: {totals[-1]}")
        for test_id in bad:
            yield ("FAIL", f"{issue} {step}: {test_id}")
    for name in key_tests:
        ids = [t for outcome in ("PASSED", "FAILED", "ERROR", "SKIPPED")
               for t in outcomes.get(outcome, []) if name in t]
        if not ids:
            yield ("MISSING", f"{issue} {step}: {name} did not run or finish")
            continue
        passed = [t for t in outcomes.get("PASSED", []) if name in t]
        yield check(len(passed) == len(ids), f"{issue} {step}: {name}: {len(passed)}/"
                                              f"{len(ids)} passed")
    m = _CAPTURE.search(text)
    if m:
        pieces, sizes, full, secs, mib = m.groups()
        yield check(float(secs) <= 10.0, f"#15 {step}: 1B capture of the default sizes "
                                         f"{secs} s (bar <= 10): {pieces} piecewise graphs "
                                         f"at {sizes} sizes, {full} full graphs, {mib} MiB")


def pytest_collected(step: str, out: Path) -> Iterator[Line]:
    """Dry run (--collect-only): the files import and the key tests are there."""
    log = out / f"{step}.log"
    issue, key_tests = _PYTEST_KEY_TESTS[step]
    text = log.read_text(errors="replace") if log.is_file() else ""
    m = re.search(r"(\d+/)?\d+ tests? collected( \(\d+ deselected\))?", text)
    yield check(m is not None and "error" not in text.lower().split("collected")[-1],
                f"{issue} {step}: " + (m.group(0) if m else "collection failed"))
    for name in key_tests:
        yield check(f"::{name}" in text, f"{issue} {step}: {name} collected")


STEPS: dict[str, Callable[[Path], Iterator[Line]]] = {
    "modes": modes, "diag": diag, "async": async_bench, "load": load, "startup": startup,
    "startup_thin": startup_thin,
    "startup_serial": startup_serial,
    "sweep": sweep, "throughput": throughput, "profile": profile, "kernels": kernels,
    "kernels_table": kernels_table,
    **{step: (lambda out, s=step: pytest_step(s, out)) for step in _PYTEST_KEY_TESTS},
    "fp8": lambda out: itertools.chain(pytest_step("fp8", out), fp8_modes(out)),
    "kvfp8": lambda out: itertools.chain(pytest_step("kvfp8", out), kvfp8_kernels(out)),
}


def verdicts(step: str, out: Path, dry_run: bool = False) -> list[str]:
    """The step's lines; [] for a step without bars."""
    judge = STEPS.get(step)
    if step.startswith("defaults_"):
        judge = functools.partial(defaults, step=step)
    if judge is None:
        return []
    if dry_run and step in _PYTEST_KEY_TESTS:
        def judge(out: Path) -> Iterator[Line]:
            yield from pytest_collected(step, out)
            if step == "fp8":  # its benchmark half ran for real
                yield from fp8_modes(out)
    try:
        lines = list(judge(out))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        lines = [("FAIL", f"{step}: cannot read its results ({type(e).__name__}: {e})")]
    if dry_run:
        lines = [(f"DRY-{v}" if v in ("PASS", "FAIL") else v, t) for v, t in lines]
    return [f"{v:<8} {t}" for v, t in lines]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step")
    ap.add_argument("out", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    for line in verdicts(args.step, args.out, args.dry_run):
        print(line)


if __name__ == "__main__":
    main()
