"""The HBM weight-streaming limit of a decode step: every step reads all weights once, so
`weight bytes / step time` can be at most the device's memory bandwidth. The sweep
reports each row's fraction of it.

Peak bandwidths are the vendors' figures by device name; a device not in the table falls
back to a measured device-to-device copy (which itself reaches ~80-90 % of the peak, so
fractions against it read high).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch when measuring only: `llmfast --help` imports this module
    import torch

logger = logging.getLogger(__name__)

# (substring of torch.cuda.get_device_name, lower case; peak bytes/s). First match
# wins, so a more specific name comes before the family's.
PEAK_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 2.0e12),
    ("h100 nvl", 3.9e12),
    ("h100", 3.35e12),  # SXM5 80GB HBM3 ("NVIDIA H100 80GB HBM3")
    ("gh200", 4.0e12),  # before "h200", which it contains
    ("h200", 4.8e12),
    ("b200", 8.0e12),
    ("a100-sxm4-80gb", 2.039e12),
    ("a100 80gb pcie", 1.935e12),
    ("a100", 1.555e12),  # the 40 GB parts
    ("l40s", 0.864e12),
    ("l40", 0.864e12),
    ("l4", 0.3e12),
    ("a10", 0.6e12),
    ("rtx 4090", 1.008e12),
)


@dataclass(frozen=True)
class DeviceBandwidth:
    name: str
    peak_bytes_per_s: float | None  # from the table; None when the name is unknown
    measured_copy_bytes_per_s: float | None  # read + write bytes of a device copy

    @property
    def limit_bytes_per_s(self) -> float | None:
        """The bandwidth fractions are taken against: the vendor's peak, else the copy."""
        return self.peak_bytes_per_s or self.measured_copy_bytes_per_s

    @property
    def source(self) -> str:
        if self.peak_bytes_per_s:
            return "spec"
        return "measured copy" if self.measured_copy_bytes_per_s else "none"


def peak_bandwidth(device_name: str) -> float | None:
    name = device_name.lower()
    for key, value in PEAK_BANDWIDTH:
        if key in name:
            return value
    return None


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30,
                           repeats: int = 10) -> float:
    """Median bytes/s (read + write) of a device-to-device copy of `nbytes`."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()  # the GiB back to the device (beside mp workers: theirs)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def device_bandwidth(device: str, device_name: str) -> DeviceBandwidth | None:
    """The bandwidth of the CUDA device `device` named `device_name`, where a model
    runner runs (None on CPU, where the sweep reports no limit). The peak comes from
    the name; the copy is measured here, and only when this process sees `device` under
    that name: the runner's own process, or its node for `mp` workers and a local Ray
    cluster (a remote Ray worker's GPU has its peak only)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    measured = None
    if _visible_as(dev, device_name):
        try:
            measured = measure_copy_bandwidth(dev)
        except torch.cuda.OutOfMemoryError:
            logger.warning("no memory left to measure the copy bandwidth")
    else:
        logger.info("%s is not visible here as %s: no measured copy bandwidth", device,
                    device_name)
    return DeviceBandwidth(device_name, peak_bandwidth(device_name), measured)


def _visible_as(device: torch.device, name: str) -> bool:
    import torch

    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        return False
    return torch.cuda.get_device_name(device) == name
