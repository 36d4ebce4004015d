"""scripts/gpu_check.py and its figures, bars and report (gpu_verdicts.py),
on the CPU: figures and verdicts from the committed raw results of earlier H100 runs, the
pytest log reader on a real GPU log, the tree stamp, the pages' update, every script
importable, and (slow) the driver's dry run of headline steps at tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check
import gpu_verdicts

H100 = REPO / "profiles" / "h100-2026-11-27"
H100B = REPO / "profiles" / "h100-2026-11-27b"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _judged(step: str, *paths: Path) -> tuple[dict, dict[str, str]]:
    samples = [s for p in paths for s in gpu_verdicts.figures(step, _load(p))]
    summary = gpu_verdicts.summarize([f for f, _ in samples])
    lines = gpu_verdicts.judge(step, summary, gpu_verdicts.merge_checks([c for _, c in samples]))
    return summary, {line["text"]: line["verdict"] for line in lines}


def _find(lines: dict[str, str], fragment: str) -> str:
    matches = [v for t, v in lines.items() if fragment in t]
    assert len(matches) == 1, (fragment, lines)
    return matches[0]


def test_modes_figures_and_bars_from_an_h100_run():
    raw = H100 / "call1-modes.json"
    lat = _load(raw)["latency_ms"]
    summary, lines = _judged("modes", raw)
    ratio = lat["full"]["1"] / lat["linears"]["1"]
    assert summary["B=1 full / linears"]["median"] == pytest.approx(ratio)
    assert summary["B=1 eager ms"]["median"] == lat["eager"]["1"]
    # Every bar verdict quotes the median it was judged on, and the bar.
    assert _find(lines, f"B=1 full / linears: median {ratio:.3g} of 1") == \
        ("PASS" if ratio <= 1.25 else "FAIL")
    assert _find(lines, "B=1 eager / full: median") == "PASS"
    assert _find(lines, "B=64 full logits vs eager") == "PASS"


def test_each_headline_steps_figures_from_real_results():
    _, lines = _judged("sweep", H100B / "call2-sweep.json")
    assert _find(lines, "every row pure decode (10 rows)") == "PASS"
    summary, lines = _judged("throughput", H100B / "call3-throughput.json")
    run = _load(H100B / "call3-throughput.json")["runs"]["default"]
    assert summary["llmfast output tok/s"]["median"] == run["throughput"]["output_tokens_per_s"]
    assert _find(lines, "llmfast / HF output tok/s: median 12.1 of 1") == "PASS"
    summary, lines = _judged("startup", H100B / "call1-startup.json")
    assert _find(lines, "warm time to first token s: median 8.3") == "PASS"
    assert _find(lines, "warm start skipped Dynamo") == "PASS"
    # kernels: a decode row a little slower than SDPA's eager call fails #17's B<=8 bar.
    raw = _load(H100B / "call4-kernels.json")
    worst = min(r["sdpa_us"] / r["ours_us"] for r in raw["decode"] if r["batch"] <= 8)
    summary, lines = _judged("kernels", H100B / "call4-kernels.json")
    assert summary["decode B<=8 worst speed vs SDPA (eager)"]["median"] == pytest.approx(worst)
    assert _find(lines, "decode B<=8 worst speed vs SDPA (eager): median") == \
        ("PASS" if worst >= 1.0 else "FAIL")
    assert "decode B<=8 worst speed vs SDPA (graph)" not in summary  # no SDPA graph rows yet
    # serve: only the `inf` rows are samples of the headline's figures.
    data = _load(H100B / "call5-serve.json")
    inf = [r for r in data["results"] if r["request_rate"] == "inf"]
    summary, _ = _judged("serve", H100B / "call5-serve.json")
    assert summary["server output tok/s"]["samples"] == [r["output_tokens_per_s"] for r in inf]


def test_kernels_samples_and_the_sdpa_graph_column():
    """bench_kernels --samples N: N timings in one JSON, each a sample; the graph column
    set against SDPA's own graph replay (like for like)."""
    raw = _load(H100B / "call4-kernels.json")
    samples = []
    for scale in (1.0, 1.1, 0.9):  # the same rows, SDPA's graph replay at 3 speeds
        decode = [dict(r, sdpa_graph_us=r["graph_us"] * scale) for r in raw["decode"]]
        samples.append(dict(decode=decode, prefill=raw["prefill"], mixed=raw["mixed"]))
    got = gpu_verdicts.figures("kernels", dict(raw, samples=samples))
    summary = gpu_verdicts.summarize([f for f, _ in got])
    s = summary["decode B<=8 worst speed vs SDPA (graph)"]
    assert s["n"] == 3 and s["median"] == pytest.approx(1.0) and s["min"] == pytest.approx(0.9)
    assert s["spread"] == pytest.approx(0.2)
    assert gpu_verdicts.merge_checks([c for _, c in got])[0]["ok"]
    # A row whose SDPA could not be captured: said, and no graph ratio made up for it.
    decode = [dict(r, sdpa_graph_us=r["graph_us"]) for r in raw["decode"]]
    decode[0] = {k: v for k, v in decode[0].items() if k != "sdpa_graph_us"}
    decode[0]["sdpa_graph_error"] = "RuntimeError: capture"
    figs, checks = gpu_verdicts.figures("kernels", dict(raw, decode=decode))[0]
    first = f"decode B={decode[0]['batch']} ctx {decode[0]['ctx']}"
    assert f"{first} llmfast / SDPA speed (graph)" not in figs
    assert checks == [(False, f"SDPA replayed from a CUDA graph on every decode row (not at "
                              f"{first.removeprefix('decode ')})")]


def test_median_and_spread():
    s = gpu_verdicts.summarize([{"a": 3.0}, {"a": 1.0, "b": 5.0}, {"a": 2.0}])
    assert s["a"] == dict(samples=[3.0, 1.0, 2.0], n=3, median=2.0, min=1.0, max=3.0,
                          spread=1.0)
    assert s["b"]["n"] == 1
    line = gpu_verdicts.judge("startup", {"warm time to first token s": dict(
        samples=[9.0, 11.0, 9.5], n=3, median=9.5, min=9.0, max=11.0, spread=2 / 9.5)}, [])
    warm = [x for x in line if "warm" in x["text"]][0]
    assert warm["verdict"] == "PASS"  # the median, not the worst sample, meets the bar
    assert "median 9.5 of 3 (9-11, spread 21.1%) (bar <= 10)" in warm["text"]
    merged = gpu_verdicts.merge_checks([[(True, "x")], [(False, "x")], [(True, "x")]])
    assert merged == [dict(text="x", ok=False, samples=3)]


def test_pytest_outcome_of_a_gpu_log_whole_and_cut_off():
    log = (H100 / "call1-full.log").read_text()
    outcome = gpu_verdicts.pytest_outcome(log)
    assert outcome["counts"] == {"passed": 20} and outcome["failed"] == []
    assert "20 passed" in outcome["totals"]
    assert gpu_verdicts.judge_tests(outcome)[0]["verdict"] == "PASS"
    # Cut off by the time limit: no totals; the files with no finished test are named.
    lines = log.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip() == "PASSED")
    collected = ["tests/test_full_graphs_gpu.py::x", "tests/test_rope_cache.py::y",
                 "tests/test_zz_never.py::z"]
    cut = gpu_verdicts.pytest_outcome("\n".join(lines[: first + 1]), collected)
    assert cut["totals"] is None and cut["counts"] == {"passed": 1}
    assert "tests/test_zz_never.py" in cut["not_reached_files"]
    assert gpu_verdicts.judge_tests(cut)[0]["verdict"] == "FAIL"


def test_a_step_is_killed_at_its_limit_even_when_silent(tmp_path):
    rc, secs = gpu_check.run(["bash", "-c", "echo started; sleep 60"], tmp_path / "x.log", 2, {})
    assert rc == 124 and secs < 10
    assert (tmp_path / "x.log").read_text() == "started\n"
    rc, _ = gpu_check.run(["bash", "-c", "exit 3"], tmp_path / "y.log", 10, {})
    assert rc == 3


@pytest.mark.slow  # ~20 s: bench_kernels' --help twice
def test_dry_run_checks_the_flags_of_gpu_only_commands(tmp_path):
    """bench_kernels needs CUDA: the dry run checks that every flag of its GPU command
    (--samples and the SDPA graph rows' flags included) is in its --help."""
    record = gpu_check.run_step(gpu_check.STEPS["kernels"], tmp_path, 120, dry=True)
    assert record["status"] == "ok", record
    assert record["verdicts"] == [dict(verdict="DRY-PASS",
                                       text="kernels: the GPU command's flags exist")]


@pytest.mark.slow  # ~1 min: every program's --help
def test_every_gpu_commands_flags_are_in_its_programs_help():
    """A misspelt or removed flag of a GPU-only command fails here, not on the device."""
    for step in gpu_check.STEPS.values():
        if step.name != "tests":
            assert gpu_check.missing_flags(step.gpu) == [], step.name
    bad = gpu_check.Step("x", "decode", 1, 1, gpu_check._BENCH + ("--no-such-flag",), ())
    assert gpu_check.missing_flags(bad.gpu) == ["--no-such-flag"]


def test_tree_stamp_names_this_tree(tmp_path, monkeypatch):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    stamp = gpu_check.tree_stamp()
    assert stamp["commit"] == head
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip())
    assert stamp["dirty"] == dirty and (stamp["diff_sha256"] is not None) == dirty
    # A carried stamp wins over the copy's git metadata (which lags on the device).
    monkeypatch.setattr(gpu_check, "STAMP", tmp_path / ".tree-stamp")
    (tmp_path / ".tree-stamp").write_text(json.dumps(dict(stamp, commit="c" * 40)))
    assert gpu_check.read_stamp(dry_run=False)["commit"] == "c" * 40
    assert gpu_check.read_stamp(dry_run=False)["source"] == ".tree-stamp"


def _result_from(step_files: dict[str, list[Path]]) -> dict:
    """A gpu_check.json as the driver assembles it, from real result files."""
    steps = {}
    for step, paths in step_files.items():
        samples = [s for p in paths for s in gpu_verdicts.figures(step, _load(p))]
        summary = gpu_verdicts.summarize([f for f, _ in samples])
        steps[step] = dict(topic=gpu_check.STEPS[step].topic, status="ok", runs=[dict(
            command=f"python3 {p.name}", rc=0, seconds=1.0, log="x.log") for p in paths],
            figures=summary, verdicts=gpu_verdicts.judge(step, summary, gpu_verdicts.
                                                           merge_checks([c for _, c in samples])))
    return dict(date="2026-11-27T10:00:00+00:00", command="python3 scripts/gpu_check.py modes",
                tree=dict(commit="a" * 40, dirty=False, source=".tree-stamp"),
                environment=dict(device="GPU 0: NVIDIA H100 80GB HBM3 (UUID: x)",
                                 torch="2.11.0", cuda="13.0", triton="3.6.0"),
                model="random:llama-3.2-1b", dtype="bfloat16", steps=steps)


def test_report_and_pages_take_the_figures_from_the_json(tmp_path):
    result = _result_from({"modes": [H100 / "call1-modes.json"],
                           "startup": [H100B / "call1-startup.json"]})
    text = gpu_verdicts.report(result)
    assert "NVIDIA H100 80GB HBM3" in text and "tree aaaaaaaaaa (clean" in text
    assert "- PASS #18 startup: warm time to first token s: median 8.3 of 1" in text
    page = tmp_path / "decode.md"
    page.write_text("# Decode\n\nintro\n\n<!-- gpu-check modes -->\nold figures\n"
                    "<!-- /gpu-check -->\n\n<!-- gpu-check sweep -->\nkept\n"
                    "<!-- /gpu-check -->\ntail\n")
    changed = gpu_verdicts.update_pages(result, tmp_path, Path("profiles/gpu/x.json"))
    assert changed == [page]
    new = page.read_text()
    assert "old figures" not in new and "kept" in new  # sweep did not run: kept
    assert new.startswith("# Decode\n\nintro") and new.endswith("tail\n")
    assert "Raw: `profiles/gpu/x.json`" in new
    assert "- PASS #15 modes: B=1 full / linears: median 1.19 of 1" in new
    assert "| B=1 full ms |" in new
    assert gpu_verdicts.raw_name(result) == "2026-11-27-h100-aaaaaaa.json"


def test_every_script_imports():
    """A script whose import broke (a moved function) fails at once on the GPU machine."""
    for path in sorted((REPO / "scripts").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses look their module up)
        spec.loader.exec_module(module)  # top level only: main() runs under __main__


def test_every_step_names_a_page_and_the_headline_is_budgeted():
    pages = {p.stem for p in (REPO / "profiles").glob("*.md")}
    for step in gpu_check.STEPS.values():
        assert step.topic in pages, step
    headline = [gpu_check.STEPS[n] for n in gpu_check.GROUPS["headline"]]
    # Every timed figure sampled 3 times: by runs, or inside the command.
    for step in headline:
        assert step.extract is None or step.samples == 3 or "--samples" in step.gpu \
            or "inf,inf,inf" in step.gpu, step.name
    # The figures leave `pytest -m gpu` at least its estimate of the default budget.
    assert sum(s.est_s for s in headline) <= 560


@pytest.mark.slow  # ~2-3 min on the shared 2-core VM: three steps' commands, tiny sizes
def test_dry_run_of_headline_steps(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu_check.py"), "--dry-run",
                           "--out", str(tmp_path), "modes", "serve", "kernels", "tests"],
                          env=env,
                          capture_output=True, check=False, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["tree"]["source"] == "git here" or result["tree"]["source"] == ".tree-stamp"
    assert result["environment"]["torch"] and "gpu_check.py" in result["command"]
    modes = result["steps"]["modes"]
    assert len(modes["runs"]) == 3 and modes["figures"]["B=1 full ms"]["n"] == 3
    assert all(v["verdict"] in ("DRY-PASS", "DRY-FAIL") for v in modes["verdicts"])
    serve = result["steps"]["serve"]
    assert serve["figures"]["server / offline output tok/s"]["n"] == 3
    tests = result["steps"]["tests"]
    assert tests["verdicts"][0]["verdict"] == "DRY-PASS", tests
    report = (tmp_path / "report.md").read_text()
    assert "## modes: ok" in report and "| B=1 full / linears |" in report


def test_bench_modes_logits_of_every_mode_agree_with_eager_on_cpu(tmp_path):
    """The modes step's own correctness check, run for real (fp32; on the CPU the full
    graph is emulated): every mode's logits equal eager's, and its verdict lines say so."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_modes.py"), "--model", "random:tiny",
         "--device", "cpu", "--batch-sizes", "1,3", "--modes", "eager,compiled,full,linears",
         "--iters", "1", "--warmup", "1", "--max-model-len", "256",
         "--json", str(tmp_path / "modes.json")],
        env=env, capture_output=True, check=False, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    agreement = json.loads((tmp_path / "modes.json").read_text())["agreement"]
    assert agreement["reference"] == "eager"
    assert set(agreement["by_batch"]) == {"1", "3"}
    for by_mode in agreement["by_batch"].values():
        assert set(by_mode) == {"compiled", "full"}
        for a in by_mode.values():
            assert a["rel_diff"] < 1e-5 and a["argmax_agree"] == 1.0, by_mode
    _, lines = _judged("modes", tmp_path / "modes.json")
    assert _find(lines, "B=3 full logits vs eager") == "PASS"


def test_interleaved_timing_alternates_the_calls_and_takes_each_ones_median(monkeypatch):
    # bench_kernels' decode ratio vs SDPA: the two timed call by call in turn, each
    # figure the median of its own calls. A fake clock stands for CUDA events: each call
    # advances it by its cost (the second function's drifting), a record reads it.
    import torch

    from llmfast.bench.kernels import cuda_timing

    clock, calls = [0.0], []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = clock[0]

        def elapsed_time(self, end):  # ms
            return end.at - self.at

    def fn(name, costs):
        costs = iter(costs)

        def call():
            calls.append(name)
            clock[0] += next(costs)
        return call

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    flush = torch.zeros(4)
    a = fn("a", [9.0] * 3 + [0.010, 0.012, 0.011])
    b = fn("b", [9.0] * 3 + [0.020, 0.050, 0.030])
    got = cuda_timing.time_us_interleaved([a, b], 3, flush, idle=True)
    assert got == pytest.approx([11.0, 30.0])  # µs: each one's median, warm-up left out
    timed = calls[calls.index("sync") + 1:]
    assert timed == ["sync", "a", "sync", "b"] * 3 + ["sync"]  # idle: a sync before each
