"""`llmfast profile` on CPU: the torch-profiler trace carries the engine's NVTX-named
phases; with `nsys` on PATH (a fake one recording its argv) the run re-executes itself
under the right `nsys profile` command line."""

from __future__ import annotations

import datetime
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from llmfast.bench.profile_run import (
    default_profile_dir,
    model_label,
    nsys_command,
    nsys_stats_command,
)
from tests.helpers.cli import invoke

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "random:tiny", "--device", "cpu", "--sizes", "1,4", "--steps", "3",
        "--context", "16"]
PHASES = ("schedule", "prepare_inputs", "sample", "update", "detokenize")




def test_profile_dir_names():
    now = datetime.datetime(2026, 11, 21, 5, 33, 6)
    expected = Path("profiles/20261121-053306-random-tiny")
    assert default_profile_dir("random:tiny", now=now) == expected
    assert model_label("/models/Llama-3.2-1B/") == "Llama-3.2-1B"
    assert model_label(None) == "SmolLM2-135M-Instruct"
    assert model_label("weird name?.gguf") == "weird-name-.gguf"


def test_nsys_command_lines():
    inner = [sys.executable, "-m", "llmfast", "profile", "--tracer", "none"]
    assert nsys_command("/opt/nsys", Path("/p/run"), inner) == [
        "/opt/nsys", "profile", "-t", "cuda,nvtx,osrt", "--cuda-graph-trace=node",
        "-o", "/p/run/trace", "--force-overwrite=true", *inner]
    assert nsys_stats_command("nsys", Path("/p/run/trace.nsys-rep")) == [
        "nsys", "stats", "--force-export=true", "/p/run/trace.nsys-rep"]


def test_profile_cpu_torch_trace_has_phases(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no nsys: auto = torch
    out = tmp_path / "prof"
    result = invoke("profile", *TINY, "--out", str(out))
    assert result.exit_code == 0, result.output
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    for phase in PHASES:
        assert phase in names, phase
    assert {"forward[1]", "forward[4]"} <= names  # decode steps at batch 1 and 4
    top = (out / "top_ops.md").read_text()
    assert "| op | calls |" in top and "aten::" in top and "`schedule`" in top
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tracer"] == "torch" and [p["batch_size"] for p in summary["sweep"]] == [1, 4]
    assert str(out / "trace.json") in result.stdout and "ui.perfetto.dev" in result.stdout

    # The same --out again is refused before any work: the first profile stays whole.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = invoke("profile", *TINY, "--out", str(out))
    assert again.exit_code == 1
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "already holds a profile" in lines[0], again.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


FAKE_NSYS = '''#!{python}
"""A stand-in for nsys: records its argv; `profile` runs the inner command and writes
an empty report, `stats` prints a line."""
import json, subprocess, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[0] == "profile":
    out = args[args.index("-o") + 1]
    inner = args[args.index("--force-overwrite=true") + 1:]
    code = subprocess.run(inner).returncode
    open(out + ".nsys-rep", "w").close()
    sys.exit(code)
if args[0] == "stats":
    print("fake nsys stats for", args[-1])
'''


def test_profile_reruns_under_nsys(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "nsys-argv.jsonl"
    fake = bin_dir / "nsys"
    fake.write_text(FAKE_NSYS.format(python=sys.executable, log=str(log)))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("LLMFAST_UNDER_NSYS", raising=False)
    out = tmp_path / "prof"
    result = invoke("profile", *TINY, "--out", str(out), "--seed", "3")
    assert result.exit_code == 0, result.output
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2
    profile_call, stats_call = calls
    assert profile_call[:7] == ["profile", "-t", "cuda,nvtx,osrt", "--cuda-graph-trace=node",
                                "-o", str(out / "trace"), "--force-overwrite=true"]
    inner = profile_call[7:]
    assert inner[:4] == [sys.executable, "-m", "llmfast", "profile"]
    assert inner[inner.index("--tracer") + 1] == "none"
    assert inner[inner.index("--out") + 1] == str(out)
    assert inner[inner.index("--sizes") + 1] == "1,4"
    for flag, value in (("--model", "random:tiny"), ("--device", "cpu"), ("--seed", "3")):
        assert inner[inner.index(flag) + 1] == value
    assert stats_call == ["stats", "--force-export=true", str(out / "trace.nsys-rep")]
    assert "fake nsys stats" in (out / "nsys-stats.txt").read_text()
    # The inner run did the work (once: it did not start nsys again).
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tracer"] == "none" and len(summary["sweep"]) == 2
    assert "trace.nsys-rep" in result.stdout and "nsys-ui" in result.stdout


def test_profile_dir_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = invoke("profile", *TINY, "--out", str(blocker / "sub"))
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot write the profile directory")
    assert "Traceback" not in result.output


def test_failed_profile_leaves_no_directory_it_created(tmp_path):
    out = tmp_path / "new" / "prof"
    result = invoke("profile", "--model", str(tmp_path / "no-such-model"), "--device", "cpu",
                    "--sizes", "1", "--out", str(out))
    assert result.exit_code == 1 and result.stderr.startswith("error:"), result.output
    assert not out.exists()
    # A directory that was there before is kept, even empty.
    out.mkdir(parents=True)
    result = invoke("profile", "--model", str(tmp_path / "no-such-model"), "--device", "cpu",
                    "--sizes", "1", "--out", str(out))
    assert result.exit_code == 1 and out.is_dir()


def test_profile_bad_sizes_and_missing_nsys(tmp_path, monkeypatch):
    result = invoke("profile", *TINY[:4], "--sizes", "8..1", "--out", str(tmp_path / "p"))
    assert result.exit_code == 1 and result.stderr.startswith("error: range")
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    result = invoke("profile", *TINY, "--tracer", "nsys", "--out", str(tmp_path / "p"))
    assert result.exit_code == 1 and "nsys is not on PATH" in result.stderr


def test_profile_empty_out_is_refused(tmp_path, monkeypatch):
    """`--out ""` (an unset shell variable) was Path(""): the current directory."""
    monkeypatch.chdir(tmp_path)
    result = invoke("profile", *TINY, "--tracer", "torch", "--out", "")
    assert result.exit_code == 1 and "--out must not be empty" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_nvtx_range_shows_in_torch_profiler_trace_only_while_profiling():
    import torch

    from llmfast.profiling.nvtx_ranges import nvtx_range

    with nvtx_range("outside-any-profiler"):
        torch.ones(2).sum()
    with torch.profiler.profile() as prof, nvtx_range("llmfast-test-range"):
        torch.ones(2).sum()
    names = {event.name for event in prof.events()}
    assert "llmfast-test-range" in names
    assert "outside-any-profiler" not in names


def test_profile_on_cpu_says_host_time_and_prints_no_profiler_noise(tmp_path):
    """A real process: Kineto writes its `USDT: ... profiler_start/stop` lines to fd 2
    from C++, which CliRunner would not see."""
    out = tmp_path / "prof"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120",
           "PATH": str(Path(sys.executable).parent)}  # no nsys: the torch profiler
    done = subprocess.run([sys.executable, "-m", "llmfast", "profile", *TINY, "--sizes", "1",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert "USDT" not in done.stderr + done.stdout and "profiler_start" not in done.stderr
    assert "host time; no device timing on CPU" in done.stdout
    assert "CUDA events" not in done.stdout and "device ms/call" not in done.stdout
    assert (out / "trace.json").is_file()  # the profiler did run


def test_phase_table_keeps_device_columns_when_timed():
    from rich.console import Console

    from llmfast.cli.profile import _phase_table
    from llmfast.profiling.phase_timing import PhaseStats

    def render(device_ms):
        phases = {"forward": PhaseStats(4, 8.0, device_ms, None if device_ms is None else 2.0)}
        con = Console(width=120, record=True, file=open(os.devnull, "w"))
        con.print(_phase_table(phases, async_scheduling=True))
        return con.export_text()

    timed = render(6.0)
    assert "device time from CUDA events" in timed and "1.500" in timed  # 6 ms / 4 calls
    assert "host overlapped" in timed and "25%" in timed
    host = render(None)
    assert "device ms/call" not in host and "2.000" in host  # 8 ms / 4 calls
