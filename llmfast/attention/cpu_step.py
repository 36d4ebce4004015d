"""`CpuStepState`: what every layer of one eager CPU step would otherwise compute alike,
computed by the first layer that asks and reused by the rest of the step's layers:

- the CPU attention's plan (attention/cpu.py), per KV-cache group (its block table),
  window and cache layout: the lookup alone (the metadata's bytes as the owner's memo
  key) cost three host copies and a hash per layer;
- the rotary rows of the step's positions, per cos/sin table: an index and a chunk per
  layer (kernels/layers/rotary_reference.py `rope_rows`);
- whether the step's slot mapping has padding slots (-1), per group: a comparison, a
  reduction and a host read per layer.

The runner's input preparation (worker/step_inputs.py) makes one per step with the
step's `AttentionMetadata`, for the torch paths only (the CPU without Triton's
interpreter); the model's eager code reads it from there (no global context). Compiled
graphs never read it (they call the ops on plain tensors, as before): a memo that a
graph kept would go stale at the next step.

Entries are keyed by the identity of the tensors they derive from and hold those
tensors, so an id is never reused while its entry lives; a state serves the forwards of
one step (whose tensors do not change in between) and is dropped with its metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmfast.attention.cpu import step_plan
from llmfast.kernels.layers.rotary_reference import rope_rows


class CpuStepState:
    __slots__ = ("_entries",)

    def __init__(self) -> None:
        # key -> (the tensors it derives from, the value)
        self._entries: dict[tuple, tuple[tuple[torch.Tensor, ...], Any]] = {}

    def _get(self, key: tuple, sources: tuple[torch.Tensor, ...],
             make: Callable[[], Any]) -> Any:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = (sources, make())
        return entry[1]

    def plan(self, k_cache: torch.Tensor, block_table: torch.Tensor,
             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, window: int | None):
        """`attention.cpu.step_plan` of these arguments, once per group and window."""
        key = ("plan", id(block_table), id(query_start_loc), id(seq_lens), window,
               tuple(k_cache.shape[1:]))
        return self._get(key, (block_table, query_start_loc, seq_lens),
                         lambda: step_plan(k_cache, block_table, query_start_loc, seq_lens,
                                           window))

    def rope(self, positions: torch.Tensor, cos_sin: torch.Tensor,
             rotate_sign: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_rows(positions, cos_sin, rotate_sign)`, once per table."""
        key = ("rope", id(positions), id(cos_sin), id(rotate_sign))
        return self._get(key, (positions, cos_sin, rotate_sign),
                         lambda: rope_rows(positions, cos_sin, rotate_sign))

    def has_padding(self, slot_mapping: torch.Tensor) -> bool:
        """Whether `slot_mapping` holds a padding slot (-1), read once per group."""
        key = ("padding", id(slot_mapping))
        return self._get(key, (slot_mapping,), lambda: bool((slot_mapping < 0).any()))
