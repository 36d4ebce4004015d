"""scripts/gpu_check.sh and its verdicts (scripts/gpu_verdicts.py), on the CPU: the bars
of issues 15 to 18 judged from results shaped like the steps' own, every script
importable, and (slow) the script's dry run of its quickest steps."""

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

from gpu_report import report
from gpu_verdicts import verdicts


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _lines(step: str, out: Path, dry_run: bool = False) -> dict[str, str]:
    """The step's verdict lines keyed by their text (after the verdict word)."""
    result = {}
    for line in verdicts(step, out, dry_run):
        word, text = line.split(None, 1)
        result[text] = word
    return result


def _find(lines: dict[str, str], fragment: str) -> str:
    matches = [v for t, v in lines.items() if fragment in t]
    assert len(matches) == 1, (fragment, lines)
    return matches[0]


def test_modes_bars_of_issue_15(tmp_path):
    lat = {"eager": {"1": 12.0, "64": 13.0}, "full": {"1": 1.9, "64": 2.0},
           "linears": {"1": 1.5, "64": 1.5}}
    _write(tmp_path / "modes.json", {"latency_ms": lat})
    lines = _lines("modes", tmp_path)
    assert _find(lines, "B=1 full / linears = 1.27") == "FAIL"  # bar 1.25
    assert _find(lines, "B=64 full / linears = 1.33") == "FAIL"  # bar 1.3
    assert _find(lines, "B=1 eager / full (speed-up) = 6.32") == "PASS"
    lat["full"] = {"1": 1.8, "64": 1.9}
    _write(tmp_path / "modes.json", {"latency_ms": lat})
    lines = _lines("modes", tmp_path)
    assert _find(lines, "B=1 full / linears") == "PASS"
    assert _find(lines, "B=64 full / linears") == "PASS"
    assert _find(lines, "B=1 eager / full") == "PASS"
    assert _find(lines, "no logits agreement") == "MISSING"


def test_modes_logits_agreement_is_judged(tmp_path):
    lat = {"eager": {"1": 12.0}, "full": {"1": 1.9}}
    ok = {"max_abs_diff": 0.05, "rel_diff": 0.03, "argmax_agree": 0.875}
    stale = {"max_abs_diff": 0.3, "rel_diff": 0.16, "argmax_agree": 0.6}
    _write(tmp_path / "modes.json", {"latency_ms": lat, "agreement": {
        "reference": "eager", "by_batch": {"1": {"full": ok}, "64": {"full": stale}}}})
    lines = _lines("modes", tmp_path)
    assert _find(lines, "B=1 full logits vs eager: max |diff| 3.0e-02") == "PASS"
    assert _find(lines, "B=64 full logits vs eager: max |diff| 1.6e-01") == "FAIL"
    assert "argmax agrees on 60% of rows" in next(t for t in lines if "B=64 full logits" in t)


def test_async_bars_of_issue_16(tmp_path):
    rows = [{"batch": 1, "model_step_ms": 1.0, "sync_ms": 2.0, "async_ms": 1.09},
            {"batch": 64, "model_step_ms": 2.0, "sync_ms": 3.0, "async_ms": 2.3},
            {"batch": 256, "model_step_ms": 6.0, "sync_ms": 7.0, "async_ms": 6.2},
            {"batch": 512, "skipped": "batch 512: some timed steps were not pure decode"}]
    _write(tmp_path / "async.json", {"rows": rows})
    lines = _lines("async", tmp_path)
    assert _find(lines, "B=1 async step / model step") == "PASS"
    assert _find(lines, "B=64 async step / model step = 1.15") == "FAIL"
    assert _find(lines, "B=256 async step / model step = 1.03") == "PASS"  # bar 1.05
    assert _find(lines, "B=512 not measured: batch 512: some timed steps") == "MISSING"


def test_load_startup_throughput_sweep_bars_of_issue_18(tmp_path):
    _write(tmp_path / "load.json", {"preset": "llama-3.2-1b", "random_init_new_s": 2.4,
                                    "cold_load_vs_read": 0.55, "warm_load_vs_read": 0.3})
    lines = _lines("load", tmp_path)
    assert _find(lines, "random init of llama-3.2-1b (s) = 2.40") == "FAIL"
    assert _find(lines, "cold load / disk read speed = 0.55") == "PASS"
    assert _find(lines, "warm load") == "INFO"
    assert not any("first-use costs" in t for t in lines)  # an older load.json
    _write(tmp_path / "load.json", {"preset": "llama-3.2-1b", "random_init_new_s": 0.4,
                                    "cold_load_vs_read": 0.55, "warm_load_vs_read": 0.3,
                                    "first_use_s": 4.5, "first_use_device_s": 0.8,
                                    "first_use_build_s": 3.7})
    lines = _lines("load", tmp_path)
    assert _find(lines, "random init of llama-3.2-1b (s) = 0.40") == "PASS"
    assert _find(lines, "process first-use costs 4.50 s (first tensor on the device "
                        "0.80 s, first build_model 3.70 s)") == "INFO"
    # Reads served from memory: no disk speed to hold the load against.
    _write(tmp_path / "load.json", {"preset": "llama-3.2-1b", "random_init_new_s": 1.0,
                                    "cold_load_vs_read": 0.55, "warm_load_vs_read": 0.3,
                                    "cold_note": "served from memory (tmpfs)"})
    assert _find(_lines("load", tmp_path), "disk speed not measured") == "MISSING"

    def run(ttft, capture):
        return {"time_to_first_token_s": ttft, "stages": {"load": 0.5, "capture": capture},
                "compile_summary": "17 pieces; 1139 piecewise CUDA graphs at 67 sizes"}
    _write(tmp_path / "startup.json",
           {"startup": {"cold": run(24.0, 11.0), "warm": run(10.5, 4.0)}})
    lines = _lines("startup", tmp_path)
    assert _find(lines, "cold time to first token (s) = 24.00") == "PASS"
    assert _find(lines, "warm time to first token (s) = 10.50") == "FAIL"
    assert _find(lines, "cold capture of the default sizes (s) = 11.00") == "FAIL"
    assert _find(lines, "warm capture") == "PASS"
    assert _find(lines, "warm stages load 0.50 s, capture 4.00 s; 17 pieces") == "INFO"
    assert _find(lines, "warm start skipped Dynamo") == "FAIL"  # the summary says compiled
    warm = {**run(9.0, 2.0), "compile_summary": "17 pieces (14 sharing another's code), "
                                                "loaded without tracing in 2.0 s"}
    _write(tmp_path / "startup.json", {"startup": {"cold": run(24.0, 11.0), "warm": warm}})
    assert _find(_lines("startup", tmp_path), "warm start skipped Dynamo") == "PASS"
    assert not any("Triton variants" in t for t in _lines("startup", tmp_path))  # older
    # The start-up's Triton precompile: a variant compiled at its launch is one missed.
    for at_launch, verdict in ((0, "PASS"), (1, "FAIL")):
        cold = {**run(24.0, 11.0),
                "triton_variants": {"precompiled": 6, "compiled_at_launch": at_launch}}
        _write(tmp_path / "startup.json", {"startup": {"cold": cold, "warm": warm}})
        assert _find(_lines("startup", tmp_path), f"cold start compiled 6 Triton variants in "
                                                  f"threads, {at_launch} at a launch") == verdict
    # A precompile that raised (the launches compiled the variants): a FAIL that says so.
    cold = {**run(24.0, 11.0), "triton_variants": {"precompiled": 0, "compiled_at_launch": 6,
                                                   "precompile_failed": 1}}
    _write(tmp_path / "startup.json", {"startup": {"cold": cold, "warm": warm}})
    assert _find(_lines("startup", tmp_path), "0 Triton variants in threads, 6 at a launch "
                                              "(the precompile raised") == "FAIL"
    _write(tmp_path / "startup_serial.json", {"startup": {"cold": run(27.5, 12.0)}})
    assert _find(_lines("startup_serial", tmp_path),
                 "cold time to first token 27.50 s with compiles serial; stages load 0.50 s, "
                 "capture 12.00 s; startup's cold start (precompile, early workers) 24.00 s: "
                 "+3.50 s saved") == "INFO"

    _write(tmp_path / "throughput.json", {"runs": {"default": {
        "speedup_vs_hf": 10.4, "total_speedup_vs_hf": 9.0, "hf_batch_size": 64,
        "throughput": {"output_tokens_per_s": 16000.0, "total_tokens_per_s": 48000.0},
        "baseline_hf": {"output_tokens_per_s": 1540.0, "total_tokens_per_s": 5300.0}}}})
    lines = _lines("throughput", tmp_path)
    assert _find(lines, "output tok/s = 10.40") == "PASS"
    assert _find(lines, "HF at batch 64: 1540 / 5300") == "INFO"
    assert not any("compiled inside" in t for t in lines)  # an older throughput.json
    _write(tmp_path / "throughput.json", {"runs": {"default": {
        "speedup_vs_hf": 3.1, "hf_batch_size": 64, "baseline_hf": {},
        "throughput": {"output_tokens_per_s": 16000.0, "total_tokens_per_s": 48000.0,
                       "triton_compiles": {"watched": True, "count": 1, "seconds": 1.9,
                                           "by_kernel": {"_unified_attention_kernel": 1}}}}}})
    assert _find(_lines("throughput", tmp_path),
                 "compiled inside the timed run = 1 (1.9 s") == "FAIL"

    point = {"batch_size": 1, "all_decode": True, "hbm_fraction": 0.6,
             "step_latency": {"median": 0.0012}, "decode_tokens_per_s": 830.0}
    config = {"device": "cuda"}
    _write(tmp_path / "sweep.json", {"runs": {"default": {
        "engine_config": config, "sweep_skipped": [],
        "sweep": [point, {**point, "batch_size": 512, "all_decode": False,
                          "hbm_fraction": None}]}}})
    lines = _lines("sweep", tmp_path)
    assert not any("compiled after start-up" in t for t in lines)  # an older sweep.json
    assert _find(lines, "all pure decode except batch [512]") == "FAIL"
    assert _find(lines, "% of HBM bandwidth on every row (missing at [512])") == "FAIL"
    assert _find(lines, "B=1 1.20 ms, 830 tok/s, 60% of HBM") == "INFO"
    _write(tmp_path / "sweep.json", {"runs": {"default": {
        "engine_config": config, "sweep_skipped": [],
        "sweep": [{**point, "triton_compiles": 0},
                  {**point, "batch_size": 2, "triton_compiles": 1}]}}})
    assert _find(_lines("sweep", tmp_path), "no Triton kernel compiled after start-up "
                 "(at batch: variants {2: 1})") == "FAIL"


def test_defaults_judge_the_default_budget_against_the_best_measured(tmp_path):
    def run(tok_s: float, budget: int) -> dict:
        return {"runs": {"default": {"engine_config": {"scheduler": {
            "max_num_batched_tokens": budget}}, "throughput": {"output_tokens_per_s": tok_s}}}}

    _write(tmp_path / "defaults_default.json", run(50000.0, 8192))
    lines = _lines("defaults_default", tmp_path)
    assert lines == {"#18 defaults_default: token budget 8192: 50000 output tok/s": "INFO"}
    _write(tmp_path / "defaults_16384.json", run(51000.0, 16384))  # within 5 %
    assert _find(_lines("defaults_16384", tmp_path),
                 "default budget (8192 tokens) gives 0.98x the output tok/s of the best "
                 "of 2 measured so far (16384 tokens: 51000)") == "PASS"
    _write(tmp_path / "defaults_2048.json", run(56000.0, 2048))  # the default loses 11 %
    lines = _lines("defaults_2048", tmp_path)
    assert _find(lines, "defaults_2048: token budget 2048: 56000") == "INFO"
    assert _find(lines, "gives 0.89x the output tok/s of the best of 3 measured so far (2048") \
        == "FAIL"
    assert _lines("defaults_4096", tmp_path) == {"#18 defaults_4096: no defaults_4096.json":
                                                 "MISSING"}


def test_sweep_fails_on_a_skipped_or_missing_size(tmp_path):
    point = {"batch_size": 1, "all_decode": True, "hbm_fraction": 0.6,
             "step_latency": {"median": 0.0012}, "decode_tokens_per_s": 830.0}
    run = {"engine_config": {"device": "cuda"}, "sweep": [point], "sweep_skipped": []}
    _write(tmp_path / "sweep.json", {"config": {"sizes": [1]}, "runs": {"default": run}})
    assert _find(_lines("sweep", tmp_path), "for each of the 1 requested sizes") == "PASS"
    run["sweep_skipped"] = [{"batch_size": 512, "reason": "prefill mixed in"}]
    _write(tmp_path / "sweep.json", {"config": {"sizes": [1, 256, 512]},
                                     "runs": {"default": run}})
    lines = _lines("sweep", tmp_path)
    assert _find(lines, "batch 512 skipped: prefill mixed in") == "FAIL"
    assert _find(lines, "3 requested sizes (none for [256, 512])") == "FAIL"


def _kernels_json(**changes) -> dict:
    """kernels.json as scripts/bench_kernels.py writes it, every #17 bar met."""
    def decode(batch, ctx, ours, sdpa, gbs):
        return {"batch": batch, "ctx": ctx, "ours_us": ours, "sdpa_us": sdpa,
                "ours_gbs": gbs, "max_abs_diff": 0.002, "fixed_max_abs_diff": 0.002}

    data = {"copy_gbs": 3000.0,
            "decode": [decode(1, 512, 10.0, 12.0, 300.0), decode(8, 8192, 40.0, 41.0, 2500.0),
                       decode(64, 2048, 100.0, 95.0, 2600.0),
                       decode(256, 8192, 1000.0, 950.0, 2700.0),
                       decode(64, 512, 50.0, 20.0, 900.0)],  # outside every bar's range
            "prefill": [{"tokens": 2048, "ours_us": 100.0, "sdpa_us": 90.0,
                         "max_abs_diff": 0.003}],
            "mixed": [{"chunk": 512, "decodes": 16, "mixed_us": 50.0, "parts_us": 60.0}]}
    for path, value in changes.items():
        section, index, key = path.split("__")
        data[section][int(index)][key] = value
    return data


def test_kernels_bars_of_issue_17(tmp_path):
    _write(tmp_path / "kernels.json", _kernels_json())
    lines = _lines("kernels", tmp_path)
    assert [w for w in lines.values() if w != "INFO"] == ["PASS"] * 6, lines
    assert _find(lines, "decode B<=8 speed vs SDPA (eager): worst 1.02 at batch 8, "
                        "ctx 8192 over 2 rows") == "PASS"
    assert not any("host us per launch" in line for line in lines)  # older JSON: none
    _write(tmp_path / "kernels.json", _kernels_json(
        decode__0__launch_host_us=9.5, decode__0__launch_host_tensors_us=13.25))
    lines = _lines("kernels", tmp_path)
    assert _find(lines, "host us per launch, addresses / tensors to the launcher: "
                        "B=1 ctx 512 9.5 / 13.2") == "INFO"
    _write(tmp_path / "kernels.json", _kernels_json(
        decode__0__ours_us=15.0, decode__3__ours_gbs=2100.0, prefill__0__ours_us=120.0,
        prefill__0__max_abs_diff=0.005, mixed__0__mixed_us=61.0, decode__2__sdpa_us=85.0,
        prefill__0__max_diff_ulps=1.0))
    lines = _lines("kernels", tmp_path)
    # What tells a rounding step (1 ulp) from a kernel error when the abs bar fails.
    assert _find(lines, "prefill max diff vs SDPA in units of the last place: 1.0 at 2048 "
                        "tokens") == "INFO"
    assert _find(lines, "decode B<=8 speed vs SDPA (eager): worst 0.8 at batch 1") == "FAIL"
    assert _find(lines, "B>=64 ctx>=2k speed vs SDPA (eager): worst 0.85 at batch 64") \
        == "FAIL"
    assert _find(lines, "fraction of copy bandwidth: worst 0.7 at batch 256") == "FAIL"
    assert _find(lines, "prefill 2k-8k causal speed vs SDPA flash: worst 0.75") == "FAIL"
    assert _find(lines, "max abs diff vs SDPA: worst 0.005 at tokens 2048") == "FAIL"
    assert _find(lines, "mixed batch time / its two parts' time: worst 1.02") == "FAIL"
    _write(tmp_path / "kernels.json", {**_kernels_json(), "prefill": []})
    assert _find(_lines("kernels", tmp_path), "prefill 2k-8k") == "MISSING"
    # kernels_table: the decode rows again with the call's installed split table; its
    # lines say so, and it judges no prefill or mixed rows (it runs none).
    _write(tmp_path / "kernels_table.json", {**_kernels_json(decode__0__ours_us=15.0),
                                             "prefill": [], "mixed": []})
    lines = _lines("kernels_table", tmp_path)
    assert _find(lines, "#17 kernels_table (this call's split table): decode B<=8 speed vs "
                        "SDPA (eager): worst 0.8 at batch 1") == "FAIL"
    assert [w for t, w in lines.items() if w != "INFO" and "B<=8" not in t] == ["PASS"] * 3
    assert not any("prefill" in t or "mixed" in t for t in lines)


def test_missing_results_and_pytest_logs(tmp_path):
    assert _find(_lines("modes", tmp_path), "no modes.json") == "MISSING"
    (tmp_path / "full.log").write_text(
        "PASSED tests/test_full_graphs_gpu.py::test_capture_counts_per_mode\n"
        "FAILED tests/test_full_graphs_gpu.py::test_greedy_tokens_identical_in_every_mode_"
        "and_equal_hf[17] - AssertionError\n"
        "PASSED tests/test_full_graphs_gpu.py::test_greedy_tokens_identical_in_every_mode_"
        "and_equal_hf[1]\n"
        "llama-3.2-1b default mode: 17 pieces around 16 attention calls (0 sharing another's"
        " code), compiled in 7.0 s (cache hits 0, misses 4); 1139 piecewise CUDA graphs at "
        "67 sizes, 51 full graphs, in 8.4 s, 412 MiB; start-up {}\n"
        "==== 1 failed, 2 passed in 200.01s ====\n")
    lines = _lines("full", tmp_path)
    assert _find(lines, "1 failed, 2 passed") == "FAIL"
    assert _find(lines, "test_greedy_tokens_identical_in_every_mode_and_equal_hf: 1/2") == "FAIL"
    assert _find(lines, "test_capture_counts_per_mode: 1/1 passed") == "PASS"
    assert _find(lines, "test_seeded_sampling_identical_in_every_mode did not run") == "MISSING"
    assert _find(lines, "capture of the default sizes 8.4 s (bar <= 10): 1139 piecewise") \
        == "PASS"
    # Cut off by the time limit: only pytest -v's progress lines (with -s, the test's
    # prints between the id and the outcome), no summary.
    (tmp_path / "full.log").write_text(
        "tests/test_full_graphs_gpu.py::test_capture_counts_per_mode \n"
        "none: 3 pieces around 2 attention calls\n"
        "PASSED [ 14%]\n"
        "tests/test_full_graphs_gpu.py::test_greedy_tokens_identical_in_every_mode_and_equal"
        "_hf \nbatch 3: all sequences PASSED\n"
        "tests/test_full_graphs_gpu.py::test_seeded_sampling_identical_in_every_mode "
        "FAILED [ 28%]\n"
        "tests/test_full_graphs_gpu.py::test_default_sizes_both_kinds_capture_on_llama_1b \n")
    lines = _lines("full", tmp_path)
    assert _find(lines, "no result line") == "FAIL"
    assert _find(lines, "test_capture_counts_per_mode: 1/1 passed") == "PASS"
    assert _find(lines, "test_seeded_sampling_identical_in_every_mode: 0/1") == "FAIL"
    assert _find(lines, "test_default_sizes_both_kinds_capture_on_llama_1b did not") \
        == "MISSING"
    assert _find(lines, "test_greedy_tokens_identical_in_every_mode_and_equal_hf did not") \
        == "MISSING"  # its print ended in PASSED; no outcome followed
    (tmp_path / "async_tests.log").write_text("Traceback ...\nKilled\n")
    assert _find(_lines("async_tests", tmp_path), "no result line") == "FAIL"
    assert verdicts("serve", tmp_path) == []  # no bars


def test_report_has_each_steps_command_outcome_verdicts_and_table(tmp_path):
    (tmp_path / "device.txt").write_text("GPU 0: NVIDIA H100 80GB HBM3 (UUID: x)\n"
                                         "torch 2.11.0 cuda 13.0 triton 3.6.0\n")
    (tmp_path / "steps.log").write_text(
        "=== modes (limit 560 s): python3 scripts/bench_modes.py --model m --json o.json\n"
        "=== modes: ok in 250 s\n"
        "=== async: SKIPPED: needs ~120 s, 30 s left in this call\n")
    (tmp_path / "verdicts.txt").write_text(
        "PASS     #15 modes: B=1 full / linears = 1.20 (bar <= 1.25)\n"
        "FAIL     #16 async: B=1 async step / model step = 1.2 (bar <= 1.1)\n")
    (tmp_path / "modes.log").write_text("[full] compiled\ndecode step latency, m\n"
                                        "batch eager ms\n     1 9.0\n")
    text = report(tmp_path)
    modes = text.split("## modes: ok in 250 s")[1].split("## async")[0]
    assert "NVIDIA H100 80GB HBM3" in text
    assert "python3 scripts/bench_modes.py --model m --json o.json" in modes
    assert "- PASS     #15 modes: B=1 full / linears" in modes and "#16" not in modes
    assert "decode step latency, m\nbatch eager ms\n     1 9.0" in modes
    assert "## async: SKIPPED: needs ~120 s" in text
    assert "- FAIL     #16 async: B=1" in text.split("## async")[1]
    # Steps of one benchmark at several settings, and a step's lines naming what they
    # judge: each section gets its own step's lines.
    (tmp_path / "steps.log").write_text(
        "=== kernels: ok in 50 s\n=== kernels_table: ok in 20 s\n"
        "=== defaults_default: ok in 30 s\n=== defaults_16384: ok in 30 s\n")
    (tmp_path / "verdicts.txt").write_text(
        "PASS     #17 kernels: decode B<=8 speed vs SDPA (eager): worst 1.02\n"
        "FAIL     #17 kernels_table (this call's split table): decode B<=8 speed: worst 0.9\n"
        "INFO     #18 defaults_default: token budget 8192: 50000 output tok/s\n"
        "INFO     #18 defaults_16384: token budget 16384: 51000 output tok/s\n"
        "PASS     #18 defaults_16384: the default budget (8192 tokens) gives 0.98x\n")
    sections = dict(part.split("\n", 1) for part in report(tmp_path).split("## ")[1:])
    assert sections["kernels: ok in 50 s"].count("- ") == 1
    assert "worst 0.9" in sections["kernels_table: ok in 20 s"]
    assert "8192: 50000" in sections["defaults_default: ok in 30 s"]
    assert sections["defaults_16384: ok in 30 s"].count("- ") == 2


def test_every_script_imports():
    """A script whose import broke (a moved function) fails at once on the GPU machine."""
    for path in sorted((REPO / "scripts").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # top level only: main() runs under __main__


@pytest.mark.slow  # ~40 s: two pytest collections and a flag check
def test_dry_run_of_the_quick_steps(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path),
           "GPU_CHECK_STATE": str(tmp_path / "state"),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "full", "async_tests",
                           "kernels"], env=env, capture_output=True, check=False, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    text = (tmp_path / "verdicts.txt").read_text()
    assert "DRY-PASS #15 full: test_default_sizes_both_kinds_capture_on_llama_1b" in text
    assert "DRY-PASS #16 async_tests: test_steady_state_steps_never_sync collected" in text
    # A budget too small for a step skips it, with a line saying so.
    env["GPU_CHECK_BUDGET_S"] = "5"
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "full"], env=env,
                          capture_output=True, check=False, text=True, timeout=120)
    assert "SKIPPED  full: needs ~" in proc.stdout
    # ... and the machine's next call runs it as the step `skipped`.
    del env["GPU_CHECK_BUDGET_S"]
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "async_tests",
                           "skipped"], env=env, capture_output=True, check=False, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "steps: async_tests full;" in proc.stdout
    assert "=== full: ok" in proc.stdout


def test_steps_behind_a_step_skipped_for_time_are_queued_behind_it(tmp_path):
    """`kernels` skipped (for lack of time; here deferred, GPU_CHECK_DEFER, which
    gpu_check treats the same way, so that no timing decides the test) leaves its split
    sweep undone: install_splits (and kernels_table after it) are queued with it for the
    next call's step `skipped`, in order, instead of being dropped; and install_splits is
    queued even when it can install another sweep of this call now (kernels64's here, a
    splits.json already in $OUT), since the next call's `kernels` sweep will need
    installing too."""
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path),
           "GPU_CHECK_STATE": str(tmp_path / "state"), "GPU_CHECK_DEFER": "kernels",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    steps = ["kernels", "install_splits", "kernels_table"]

    def run() -> subprocess.CompletedProcess:
        proc = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), *steps], env=env,
                              capture_output=True, check=False, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        assert "SKIPPED  kernels: deferred" in proc.stdout
        assert "QUEUED   install_splits: after kernels" in proc.stdout
        assert "QUEUED   kernels_table: after install_splits" in proc.stdout
        assert (tmp_path / "state" / "skipped").read_text().split() == steps
        return proc

    proc = run()  # no sweep in $OUT: nothing to install now
    assert "=== install_splits" not in proc.stdout
    assert not (tmp_path / "splits_installed.json").exists()
    queued = report(tmp_path).split("## queued for the next call's `skipped`")[1]
    assert "install_splits: after kernels" in queued and "kernels_table" in queued

    shipped = REPO / "llmfast/attention/tuning/split_tables/nvidia-h100-80gb-hbm3.json"
    (tmp_path / "splits.json").write_text(shipped.read_text())
    proc = run()  # another sweep of the call installed now, and still queued
    assert "=== install_splits: ok" in proc.stdout
    assert (tmp_path / "splits_installed.json").exists()


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
    lines = _lines("modes", tmp_path)
    assert _find(lines, "B=3 full logits vs eager") == "PASS"


def test_fp8_step_compares_with_bf16_and_judges_its_agreement(tmp_path):
    ok = {"max_abs_diff": 0.05, "rel_diff": 0.03, "argmax_agree": 1.0}
    bad = {"max_abs_diff": 0.5, "rel_diff": 0.3, "argmax_agree": 0.2}
    _write(tmp_path / "modes_bf16.json", {"latency_ms": {"full": {"1": 1.0, "64": 1.2}}})
    _write(tmp_path / "modes_fp8.json", {
        "latency_ms": {"full": {"1": 0.625, "64": 0.8}},
        "agreement": {"reference": "eager", "by_batch": {"1": {"full": ok},
                                                         "64": {"full": bad}}}})
    (tmp_path / "fp8.log").write_text(
        "tests/test_fp8_gpu.py::test_scaled_mm_layer_matches_float64_fake_quant[1] PASSED [ 50%]\n"
        "tests/test_fp8_gpu.py::test_1b_fp8_generates_close_to_bf16 FAILED [100%]\n"
        "=========== 1 failed, 1 passed in 30.0s ===========\n")
    lines = _lines("fp8", tmp_path)
    assert _find(lines, "B=1 full-graph step 0.625 ms vs bf16 1.000 ms (1.60x)") == "INFO"
    assert _find(lines, "fp8 modes: B=64 full logits vs eager") == "FAIL"
    assert _find(lines, "fp8 modes: B=1 full logits vs eager") == "PASS"
    assert _find(lines, "test_1b_fp8_generates_close_to_bf16: 0/1 passed") == "FAIL"


def test_kvfp8_step_reads_its_decode_rows(tmp_path):
    rows = [{"batch": 1, "ctx": 2048, "ours_us": 10.0, "sdpa_us": 12.0, "ours_gbs": 1500.0,
             "max_abs_diff": 1e-3},
            {"batch": 64, "ctx": 8192, "ours_us": 400.0, "sdpa_us": 500.0, "ours_gbs": 2400.0,
             "max_abs_diff": 5e-3}]
    _write(tmp_path / "kernels_kvfp8.json", {"copy_gbs": 3000.0, "decode": rows})
    (tmp_path / "kvfp8.log").write_text(
        "tests/test_kv_cache_fp8_gpu.py::test_decode_attention[64-32-8] PASSED [ 50%]\n"
        "=========== 1 passed in 9.0s ===========\n")
    lines = _lines("kvfp8", tmp_path)
    assert _find(lines, "kvfp8 decode B=1 ctx 2048: 10.0 us vs SDPA bf16 12.0 us (1.20x), "
                        "50% of copy bandwidth") == "INFO"
    assert _find(lines, "max abs diff vs SDPA: worst 0.005 at batch 64, ctx 8192") == "FAIL"
    assert _find(lines, "test_prefill_attention did not run") == "MISSING"


def test_interleaved_timing_alternates_the_calls_and_takes_each_ones_median(monkeypatch):
    # bench_kernels' decode ratio vs SDPA: the two timed call by call in turn, each
    # figure the median of its own calls. A fake clock stands for CUDA events: each call
    # advances it by its cost (the second function's drifting), a record reads it.
    import bench_kernels_lib
    import torch

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
    got = bench_kernels_lib.time_us_interleaved([a, b], 3, flush, idle=True)
    assert got == pytest.approx([11.0, 30.0])  # µs: each one's median, warm-up left out
    timed = calls[calls.index("sync") + 1:]
    assert timed == ["sync", "a", "sync", "b"] * 3 + ["sync"]  # idle: a sync before each
