"""Versions and hardware a benchmark ran on, for its JSON result.

Two machines may be involved: the host facts (CPU, Python, versions) are this process's;
the device facts (GPU name and memory, CUDA version) are those rank 0 of the engine
measured where it runs (its `RunnerInfo`), which may be a worker process or an actor of
a remote Ray cluster driven from a host without a GPU. `local_device_facts` queries this
process's device instead, for measurements without an engine (a model built in
process, the HF baseline alone).
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmfast.worker.runner_info import RunnerInfo

GiB = 2**30


def environment_info(device_facts: dict) -> dict:
    """This host's versions and CPU, with `device_facts` (from `rank_device_facts` or
    `local_device_facts`), so a JSON result says where it came from."""
    import torch

    from llmfast.version import __version__

    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    return {
        "device": device_facts["device"],
        "torch": torch.__version__,
        "transformers": hf_version,
        "llmfast": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        **device_facts,
    }


def rank_device_facts(info: RunnerInfo) -> dict:
    """The device facts a rank reported about itself (measured in its own process)."""
    if info.device_memory_bytes is None:  # not a GPU
        return {"device": info.device}
    return _gpu_facts(info.device, info.device_name, info.device_memory_bytes,
                      info.cuda_version)


def local_device_facts(device: str) -> dict:
    """The device facts of `device` as this process sees it."""
    if not device.startswith("cuda"):
        return {"device": device}
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return _gpu_facts(device, props.name, props.total_memory, torch.version.cuda)


def _gpu_facts(device: str, name: str, memory_bytes: int, cuda: str | None) -> dict:
    return {"device": device, "gpu": name, "gpu_memory_gib": round(memory_bytes / GiB, 1),
            "cuda": cuda}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
