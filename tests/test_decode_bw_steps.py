"""The GPU check's #49 steps (scripts/gpu_check.py, gpu_verdicts.py) on the CPU: every
group's steps exist and fit a call's budget, the sweeps set LLMFAST_GEMV as named, and
the cross-step bars (fp8 over bf16 at batch 1, batch 64-512 unchanged by the GEMV)
judge figures taken from a real H100 sweep."""

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
                                   "decode_bw_fused", "tune_bf16", "tune_fp8"])
def test_groups_fit_one_call(group):
    steps = [gpu_check.STEPS[n] for n in gpu_check.GROUPS[group]]
    assert sum(s.est_s for s in steps) <= 560  # gpu_check's default budget
    for s in steps:
        assert s.topic == "decode-bw"
        assert s.dry and s.gpu


def test_sweep_steps_name_their_kernels():
    step = gpu_check.STEPS["bw_8b_fp8_gemv"]
    assert step.env == {"LLMFAST_GEMV": "1"}
    assert "random:llama-3.1-8b" in step.gpu and ("--quantization", "fp8") == \
        step.gpu[step.gpu.index("--quantization"):step.gpu.index("--quantization") + 2]
    assert "1..512" in step.gpu and step.extract == "sweep"
    assert gpu_check.STEPS["bw_1b_cublas"].env == {"LLMFAST_GEMV": "0"}
    assert gpu_check.STEPS["bw_1b_fused"].env["LLMFAST_GEMV_FUSE"] == "1"
    kinds = gpu_check.STEPS["kinds_1b_gemv"]
    assert "{out}/kinds_1b_gemv.json" in kinds.gpu and "--kinds-json" in kinds.dry
    tune = gpu_check.STEPS["gemv_tune_fp8"]
    assert {"--tune", "--install", "--fp8"} <= set(tune.gpu)


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


def test_hbm_bars_on_the_gemv_sweeps():
    data = json.loads(SWEEP.read_text())
    summary = _record(data, 1.0)["figures"]
    hbm = summary["B=1 % of HBM"]["median"]
    lines = gpu_verdicts.judge("bw_1b_gemv", summary, [])
    (bar,) = [v for v in lines if "% of HBM" in v["text"]]
    assert bar["verdict"] == ("PASS" if hbm >= 75 else "FAIL")
    assert "bar >= 75" in bar["text"]
