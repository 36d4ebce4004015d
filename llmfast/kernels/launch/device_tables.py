"""Per-GPU-model JSON tables shipped with the package (launch configurations measured on
one GPU model: the MoE tiles, the GEMV's launch table, the attention's prefill tiles),
found by the device's name."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


def device_slug(device_name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3": a table's file name."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def read_shipped_table(directory: Path, device_name: str, parse: Callable[[dict], T],
                       what: str) -> T | None:
    """`parse` of `directory/<slug>.json`; None if there is none, or (logged) if it is
    unreadable or `parse` refuses it: a bad table must not stop the engine."""
    path = directory / f"{device_slug(device_name)}.json"
    if not path.is_file():
        return None
    try:
        return parse(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as e:
        logger.warning("ignoring the %s %s: %s", what, path, e)
        return None
