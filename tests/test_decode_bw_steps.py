"""The GPU check's #49 steps (scripts/gpu_check.py, gpu_verdicts.py) on the CPU: every
group's steps exist and fit a call's budget, the sweeps pass --gemv as named, the
start-up measurement's step writes its table for shipping, and the cross-step bars (fp8
over bf16 at batch 1, batch 64-512 unchanged by the GEMV, --gemv auto never slower than
cuBLAS) judge figures taken from a real H100 sweep."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402
import gpu_verdicts  # noqa: E402

SWEEP = REPO / "profiles" / "h100-2026-11-27b" / "call2-sweep.json"


@pytest.mark.parametrize("group", ["decode_bw", "decode_bw_8b", "decode_bw_kinds_8b",
                                   "decode_bw_fused", "tune_bf16", "tune_fp8",
                                   "tune_startup", "tune_startup_8b"])
def test_groups_fit_one_call(group):
    steps = [gpu_check.STEPS[n] for n in gpu_check.GROUPS[group]]
    assert sum(s.est_s for s in steps) <= 560  # gpu_check's default budget
    for s in steps:
        assert s.topic == "decode-bw"
        assert s.dry and s.gpu


def _flag(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_sweep_steps_name_their_kernels():
    step = gpu_check.STEPS["bw_8b_fp8_gemv"]
    assert _flag(step.gpu, "--gemv") == _flag(step.dry, "--gemv") == "triton"
    assert not step.env  # flags, no environment knobs
    assert "random:llama-3.1-8b" in step.gpu and _flag(step.gpu, "--quantization") == "fp8"
    assert "1..512" in step.gpu and step.extract == "sweep"
    assert _flag(gpu_check.STEPS["bw_1b_cublas"].gpu, "--gemv") == "cublas"
    assert _flag(gpu_check.STEPS["bw_8b_auto"].gpu, "--gemv") == "auto"
    fused = gpu_check.STEPS["bw_1b_fused"].gpu
    assert "--gemv-fuse" in fused and _flag(fused, "--gemv") == "triton"
    kinds = gpu_check.STEPS["kinds_1b_gemv"]
    assert "{out}/kinds_1b_gemv.json" in kinds.gpu and "--kinds-json" in kinds.dry
    assert _flag(kinds.gpu, "--gemv") == _flag(kinds.dry, "--gemv") == "triton"
    tune = gpu_check.STEPS["gemv_tune_fp8"]
    assert {"--tune", "--install", "--fp8"} <= set(tune.gpu)


def test_startup_step_measures_both_presets_in_bf16_and_fp8():
    step = gpu_check.STEPS["gemv_startup"]
    assert "--startup" in step.gpu and _flag(step.gpu, "--quantizations") == "none,fp8"
    assert _flag(step.gpu, "--models").split(",") == list(gpu_check._BW_MODELS.values())
    assert _flag(step.gpu, "--copy-to") == "{out}/gemv_startup_table.json"
    # Each auto sweep's cross bars have their base earlier in the same call.
    for group in ("tune_startup", "tune_startup_8b"):
        names = gpu_check.GROUPS[group]
        bars = [b for b in gpu_verdicts.CROSS_BARS if b.step in names]
        assert {b.step for b in bars} == {n for n in names if n.endswith("_auto")}
        for bar in bars:
            assert names.index(bar.base) < names.index(bar.step), bar


def _record(data: dict, scale: float) -> dict:
    """A step record whose step times are the sweep's times x scale."""
    data = copy.deepcopy(data)
    for p in data["runs"]["default"]["sweep"]:
        p["step_latency"]["median"] *= scale
    figs = gpu_verdicts.figures("sweep", data)
    return {"figures": gpu_verdicts.summarize([f for f, _ in figs])}


def test_cross_bars_from_a_real_sweep():
    data = json.loads(SWEEP.read_text())
    sizes = {p["batch_size"] for p in data["runs"]["default"]["sweep"]}
    assert {1, 64, 256, 512} <= sizes
    steps = {"bw_8b_gemv": _record(data, 1.0), "bw_8b_fp8_gemv": _record(data, 1 / 1.7)}
    (fp8,) = [v for v in gpu_verdicts.judge_cross("bw_8b_fp8_gemv", steps)
              if "fp8 over bf16" in v["text"]]
    assert fp8["verdict"] == "PASS" and "1.7" in fp8["text"]
    steps["bw_8b_fp8_gemv"] = _record(data, 1 / 1.5)
    (fp8,) = [v for v in gpu_verdicts.judge_cross("bw_8b_fp8_gemv", steps)
              if "fp8 over bf16" in v["text"]]
    assert fp8["verdict"] == "FAIL"
    # GEMV on vs off at 64-512: 2 % slower passes, 10 % fails; the worst batch is named.
    steps = {"bw_1b_cublas": _record(data, 1.0), "bw_1b_gemv": _record(data, 1.02)}
    (large,) = gpu_verdicts.judge_cross("bw_1b_gemv", steps)
    assert large["verdict"] == "PASS"
    steps["bw_1b_gemv"] = _record(data, 1.1)
    (large,) = gpu_verdicts.judge_cross("bw_1b_gemv", steps)
    assert large["verdict"] == "FAIL" and "worst at B=" in large["text"]
    # The base in this call but without figures (it failed): MISSING; not run: SKIPPED.
    assert gpu_verdicts.judge_cross("bw_1b_gemv", {"bw_1b_gemv": steps["bw_1b_gemv"],
                                                   "bw_1b_cublas": {}})[0]["verdict"] == \
        "MISSING"
    assert gpu_verdicts.judge_cross("bw_1b_gemv", {"bw_1b_gemv": steps["bw_1b_gemv"]}
                                    )[0]["verdict"] == "SKIPPED"
    # --gemv auto: at the decode sizes no slower than cuBLAS (3 % of noise), and past them.
    steps = {"bw_1b_cublas": _record(data, 1.0), "bw_1b_auto": _record(data, 1 / 1.2)}
    lines = gpu_verdicts.judge_cross("bw_1b_auto", steps)
    assert [v["verdict"] for v in lines] == ["PASS", "PASS"]
    steps["bw_1b_auto"] = _record(data, 1.05)
    decode, large = gpu_verdicts.judge_cross("bw_1b_auto", steps)
    assert decode["verdict"] == "FAIL" and "auto speed vs cuBLAS" in decode["text"]
    assert large["verdict"] == "PASS"  # 5 % slower: within the 0.95 bar


def test_hbm_bars_on_the_gemv_sweeps():
    data = json.loads(SWEEP.read_text())
    summary = _record(data, 1.0)["figures"]
    hbm = summary["B=1 % of HBM"]["median"]
    lines = gpu_verdicts.judge("bw_1b_gemv", summary, [])
    (bar,) = [v for v in lines if "% of HBM" in v["text"]]
    assert bar["verdict"] == ("PASS" if hbm >= 75 else "FAIL")
    assert "bar >= 75" in bar["text"]
