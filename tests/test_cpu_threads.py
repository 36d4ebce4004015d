"""The intra-op thread count on a CPU: from the cores allowed, the cgroup quota and the
cores other processes keep busy, measured from /proc; the user's OMP_NUM_THREADS kept."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from llmfast import LLM
from llmfast.worker.startup import cpu_threads
from llmfast.worker.startup.cpu_threads import (
    CpuTimes,
    allowed_cpus,
    cgroup_cpu_quota,
    choose_cpu_threads,
    configure_cpu_threads,
    others_busy_cores,
    read_cpu_times,
    sample_cpu_times,
)

STAT = """cpu  300 0 100 1000 0 0 0 0 0 0
cpu0 100 0 50 500 0 0 0 0 0 0
cpu1 200 0 50 500 10 0 0 5 0 0
cpu2 999 0 0 0 0 0 0 0 0 0
intr 12345
"""
SELF_STAT = "4242 (python -m x) S 1 2 3 4 5 6 7 8 9 10 30 7 0 0 20 0 3 0 100"


def test_proc_stat_is_read_for_the_allowed_cpus_only():
    times = read_cpu_times(frozenset({0, 1}), STAT, SELF_STAT)
    # cpu0: 150 busy of 650; cpu1: 255 busy of 765 (iowait is idle, steal busy).
    assert times == CpuTimes(busy=150 + 255, total=650 + 765, own=30 + 7)


def test_others_busy_cores_arithmetic():
    # 2 CPUs, 100 ticks each pass; 150 busy ticks of which 40 ours: 1.1 cores others'.
    before, after = CpuTimes(0, 0, 0), CpuTimes(150, 200, 40)
    assert others_busy_cores(before, after, 2) == pytest.approx(1.1)
    assert others_busy_cores(after, after, 2) == 0.0  # no time passed
    assert others_busy_cores(before, CpuTimes(10, 200, 40), 2) == 0.0  # never negative


@pytest.mark.parametrize("allowed, quota, others, threads", [
    (2, None, 0.05, 2),   # quiet
    (2, None, 0.7, 1),    # one busy process beside the weight loading
    (2, None, 0.4, 2),    # a core mostly free stays ours
    (2, None, 1.9, 1),    # at least one
    (8, None, 2.0, 6),
    (8, 1.5, 0.0, 1),     # a cgroup quota of 1.5 CPUs: one whole one
    (8, 4.0, 1.0, 3),
    (2, 8.0, 0.0, 2),     # a quota above the cores allowed
])
def test_choose_cpu_threads(allowed, quota, others, threads):
    assert choose_cpu_threads(allowed, quota, others) == threads


def test_cgroup_quota_v2_takes_the_tightest_ancestor(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "a" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("300000 100000\n")
    assert cgroup_cpu_quota("0::/a/b\n", tmp_path) == 1.5
    assert cgroup_cpu_quota("0::/\n", tmp_path) is None


def test_cgroup_quota_v1(tmp_path):
    folder = tmp_path / "cpu" / "docker" / "x"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("250000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    text = "4:memory:/docker/x\n2:cpu,cpuacct:/docker/x\n0::/\n"
    assert cgroup_cpu_quota(text, tmp_path) == 2.5
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(text, tmp_path) is None


def test_a_busy_process_is_measured():
    """A real busy process beside this (sleeping) one: at least most of a core is
    counted as others' (more where the machine is shared)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        before = sample_cpu_times()
        time.sleep(0.5)
        after = sample_cpu_times()
    finally:
        busy.kill()
        busy.wait()
    others = others_busy_cores(before, after, len(allowed_cpus()))
    assert others >= 0.7, others


@pytest.fixture
def torch_threads(monkeypatch):
    """No OMP_NUM_THREADS (the suite's workers set one); torch's count put back after."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    saved, chosen = torch.get_num_threads(), list(cpu_threads._chosen)
    torch.set_num_threads(len(allowed_cpus()))  # torch's own default
    yield
    torch.set_num_threads(saved)
    cpu_threads._chosen[:] = chosen


def test_engine_start_sets_the_threads_from_the_cores(torch_threads):
    LLM("random:tiny", device="cpu", enforce_eager=True)
    assert 1 <= torch.get_num_threads() <= len(allowed_cpus())
    assert cpu_threads._chosen == [torch.get_num_threads()]


def test_user_settings_are_kept(torch_threads, monkeypatch):
    started, before = time.perf_counter(), sample_cpu_times()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert configure_cpu_threads(before, started) is None
    assert torch.get_num_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    if len(allowed_cpus()) != 3:  # torch.set_num_threads(3) by the user, not by llmfast
        assert configure_cpu_threads(before, started) is None
        assert torch.get_num_threads() == 3
    torch.set_num_threads(len(allowed_cpus()))
    chosen = configure_cpu_threads(before, started)
    assert chosen == torch.get_num_threads()
    assert 1 <= chosen <= len(allowed_cpus())
