"""Versions and hardware of the machine a benchmark ran on, for its JSON result."""

from __future__ import annotations

import platform


def environment_info(device: str) -> dict:
    """Versions and hardware, so a JSON result says where it came from."""
    import torch

    from llmfast.version import __version__

    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    info = {
        "device": device,
        "torch": torch.__version__,
        "transformers": hf_version,
        "llmfast": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
