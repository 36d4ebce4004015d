"""The checks `EngineArgs` runs when it is made: each field's type and range, read from
the field (its annotation, `minimum=`, `maximum=`), and the flags that contradict each
other, before anything is resolved or loaded."""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from typing import Any

from llmfast.config import (
    ConfigError,
    CudaGraphMode,
    check_quantization,
    parse_cuda_graph_mode,
    parse_kv_cache_dtype,
)
from llmfast.utils.value_checks import describe, is_int, is_number

# `args` below is an `EngineArgs`, unnamed: engine/args.py calls these checks, and a
# type-only import back would tie the two modules in a cycle.


def check_engine_args(args: Any) -> None:
    """Types and lower bounds, read from the fields (type, `minimum=`), before anything is
    resolved or loaded: `LLM(seed=-1)` and `LLM(max_model_len=0)` fail as `--seed -1`
    and `--max-model-len 0` do."""
    hints = typing.get_type_hints(type(args))
    for f in fields(args):
        value = getattr(args, f.name)
        if value is None and f.default is None:
            continue
        kind, low, high = (plain_type(hints[f.name]), f.metadata.get("minimum"),
                           f.metadata.get("maximum"))
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{_flag(f.name)} must be True or False, got {describe(value)}")
        if kind is int and (not is_int(value) or (low is not None and value < low)):
            what = {0: "a non-negative integer", 1: "a positive integer"}.get(
                low, f"an integer >= {low}")
            raise ConfigError(f"{_flag(f.name)} must be {what}, got {describe(value)}")
        if kind is int and high is not None and value > high:
            raise ConfigError(f"{_flag(f.name)} must be at most {high}, got {value}")
        if kind is float and not is_number(value):
            raise ConfigError(f"{_flag(f.name)} must be a number, got {describe(value)}")
    for name in ("dtype", "device"):
        value = getattr(args, name)
        if not isinstance(value, str) and not (name == "dtype" and _is_torch_dtype(value)):
            raise ConfigError(f"{name} must be a string, got {describe(value)}")
    check_quantization(args.quantization)
    parse_kv_cache_dtype(args.kv_cache_dtype)
    if args.model is not None and not isinstance(args.model, str):
        raise ConfigError(f"model must be a path or name (a string), got {describe(args.model)}")
    if args.enforce_eager is True and args.compile is True:
        raise ConfigError("--enforce-eager runs without torch.compile, which --compile asks "
                          "for; drop one of the two")
    if args.cuda_graph_mode is not None:
        _check_graph_mode_wanted(args)
    # An unknown backend, or uni with several ranks, fails here too.
    args.parallel_config()
    args.gemv_config()
    if args.speculative_method is not None and not isinstance(args.speculative_method, str):
        raise ConfigError(f"speculative-method must be ngram or draft, got "
                          f"{describe(args.speculative_method)}")
    # Speculative decoding's flags that contradict each other or another flag.
    args.speculative_config()
    for flag in ("cuda_graph_sizes", "piecewise_graph_sizes"):
        sizes = getattr(args, flag)
        if sizes is not None and (isinstance(sizes, (str, bytes)) or not all(
                is_int(s) and s > 0 for s in sizes)):
            raise ConfigError(f"{flag.replace('_', '-')} must be positive integers, "
                              f"got {sizes!r:.60}")


def _check_graph_mode_wanted(args: Any) -> None:
    """An unknown mode name fails here, early; so does a mode with graphs that another
    flag turns off, which would otherwise run without graphs and say nothing."""
    mode = parse_cuda_graph_mode(args.cuda_graph_mode)
    if mode is CudaGraphMode.NONE:
        return
    off = [flag for flag, is_set in (("--enforce-eager", args.enforce_eager is True),
                                     ("--no-compile", args.compile is False),
                                     ("--no-cuda-graphs", args.cuda_graphs is False))
           if is_set]
    if off:
        raise ConfigError(f"--cuda-graph-mode {mode.value} replays CUDA graphs, which "
                          f"{off[0]} turns off; drop one of the two")


def _is_torch_dtype(value: Any) -> bool:
    import torch

    return isinstance(value, torch.dtype)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def plain_type(hint: Any) -> Any:
    """`int | None` -> int; `tuple[int, ...] | None` -> tuple[int, ...]."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    return hint
