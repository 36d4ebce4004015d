"""`StagingBuffer` (worker/buffers.py): per-step arrays of varying size staged through
one persistent host buffer, grown geometrically, never per step."""

from __future__ import annotations

import numpy as np
import torch

from llmfast.worker.buffers import StagingBuffer


def test_stage_returns_the_values_in_shape_and_grows_only_when_needed():
    buf = StagingBuffer(torch.int64, torch.device("cpu"))
    first = np.arange(12, dtype=np.int64).reshape(3, 4)
    out = buf.stage(first)
    assert out.shape == (3, 4) and torch.equal(out, torch.from_numpy(first))
    storage = buf.cpu.data_ptr()
    small = np.array([[7, 8]], dtype=np.int64)
    assert torch.equal(buf.stage(small), torch.from_numpy(small))
    assert buf.cpu.data_ptr() == storage  # reused, not reallocated
    big = np.arange(1000, dtype=np.int64)
    assert torch.equal(buf.stage(big), torch.from_numpy(big))
    assert buf.cpu.numel() >= 1000


def test_an_empty_first_array_still_gets_a_buffer_of_the_staging_device():
    # Before the fix, .gpu was still the initial empty CPU tensor here: on CUDA an empty
    # first array came back on the host.
    buf = StagingBuffer(torch.int64, torch.device("cpu"))
    out = buf.stage(np.zeros((0, 3), dtype=np.int64))
    assert out.shape == (0, 3) and buf.cpu.numel() >= 256
