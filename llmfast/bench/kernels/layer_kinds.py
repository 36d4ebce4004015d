"""Where a decode step's time goes, per layer kind: the bytes each kind must move, the
time it takes, and the fraction of the HBM bandwidth that is (issue #49's table).

Kinds: the projections (qkv, o, gate_up, down), the lm_head, attention (the KV cache
read and the new keys and values written), and everything else (norms, RoPE, SiLU-and-
mul, embedding, residual adds, activation quantization). A projection's bytes are its
parameters (fp8 weights and their scales as stored) plus its activation rows; the
attention's are the context's keys and values in the cache's dtype. At batch 1 a kind at
100 % of HBM streams its bytes at the device's peak: the distance from it is what a
better kernel can win.

The times come from scripts/bench_modes.py --kinds-json: each projection kind's layers
replayed alone from one CUDA graph (the kernels the model chooses: cuBLAS, the GEMV,
fp8), attention and the rest from the profiler's kernel times inside the full-graph
step, by kernel name (`classify_kernel`). This module holds the arithmetic and the table,
testable without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LINEAR_KINDS = ("qkv", "o", "gate_up", "down", "lm_head")
KINDS = (*LINEAR_KINDS, "attention", "other")
# Module-name suffix -> kind (the decoder's names: models/decoder.py).
_SUFFIXES = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up",
             "down_proj": "down", "lm_head": "lm_head"}
# Substrings of profiler kernel names (lower case), first match wins; a kernel matching
# none is counted a projection's (cuBLAS's kernel names change with its releases).
_KERNEL_KINDS = (
    ("gemv", "linear"), ("splitkreduce", "linear"), ("nvjet", "linear"),
    ("gemm", "linear"), ("cutlass", "linear"), ("scaled_mm", "linear"),
    ("attention", "attention"), ("rope_and_cache", "attention"),
    ("reshape_and_cache", "attention"), ("merge_splits", "attention"),
    ("rms_norm", "other"), ("rotary", "other"), ("triton_", "other"),
    ("embedding", "other"), ("memset", "other"), ("memcpy", "other"),
    ("copy_kernel", "other"), ("elementwise", "other"), ("reduce_kernel", "other"),
    ("argmax", "other"),
)


def linear_kind(module_name: str) -> str | None:
    """"model.layers.3.self_attn.qkv_proj" -> "qkv"; None for a module of no kind."""
    return _SUFFIXES.get(module_name.rsplit(".", 1)[-1])


def classify_kernel(name: str) -> str:
    """A profiled kernel's kind: "attention", "other", or "linear" (any projection: which
    one is not in a cuBLAS kernel's name, so projections are timed by kind apart)."""
    lower = name.lower()
    return next((kind for key, kind in _KERNEL_KINDS if key in lower), "linear")


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def kind_modules(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """The model's projection modules by kind, in module order."""
    out: dict[str, list[torch.nn.Module]] = {k: [] for k in LINEAR_KINDS}
    for name, module in model.named_modules():
        kind = linear_kind(name)
        if kind is not None:
            out[kind].append(module)
    return out


@dataclass(frozen=True)
class StepShape:
    """What a decode step of `batch` requests at `context` tokens each reads besides the
    weights: the attention's KV cache, the activations."""

    batch: int
    context: int
    num_layers: int
    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    act_bytes: int  # an activation element (the model dtype)
    kv_bytes: int  # a KV-cache element


def step_shape(model: torch.nn.Module, batch: int, context: int,
               kv_dtype: torch.dtype | None = None) -> StepShape:
    """The shape of `model` (a DecoderForCausalLM: its rank config), its dtype that of
    its norms; the KV cache in `kv_dtype` (default the model dtype)."""
    cfg = model.rank_config
    act = model.model.norm.weight.element_size()
    kv = torch.empty(0, dtype=kv_dtype).element_size() if kv_dtype is not None else act
    return StepShape(batch, context, cfg.num_hidden_layers, cfg.num_attention_heads,
                     cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                     cfg.intermediate_size, act, kv)


def kind_bytes(model: torch.nn.Module, shape: StepShape) -> dict[str, int]:
    """Bytes each kind moves in one decode step (a tied lm_head: the embedding's weight,
    read whole as the head)."""
    out = dict.fromkeys(KINDS, 0)
    for kind, modules in kind_modules(model).items():
        for m in modules:
            k = getattr(m, "in_features", 0)
            n = getattr(m, "out_features", 0)
            out[kind] += _param_bytes(m) + shape.batch * (k + n) * shape.act_bytes
    s = shape
    per_token_kv = 2 * s.num_kv_heads * s.head_dim * s.kv_bytes  # a token's K and V
    q_and_out = 2 * s.num_heads * s.head_dim * s.act_bytes
    out["attention"] = s.num_layers * s.batch * (s.context * per_token_kv + q_and_out)
    # Norms (2 a layer + the final one: weight, and the row read and written with its
    # residual), SiLU-and-mul (gate and up read, product written), the embedding rows.
    norms = (2 * s.num_layers + 1) * (s.hidden_size * s.act_bytes
                                      + 4 * s.batch * s.hidden_size * s.act_bytes)
    silu = s.num_layers * 3 * s.batch * s.intermediate_size * s.act_bytes
    out["other"] = norms + silu + 2 * s.batch * s.hidden_size * s.act_bytes
    return out


def table(bytes_by_kind: dict[str, int], us_by_kind: dict[str, float | None],
          step_us: float | None, peak_bytes_per_s: float | None) -> list[dict]:
    """Rows per kind, then "step": bytes, µs, GB/s, % of the HBM peak, share of the step.
    A kind without a time (not measured) keeps its bytes and its HBM-limit time."""
    rows = []

    def row(kind: str, nbytes: int, us: float | None) -> dict:
        limit_us = nbytes / peak_bytes_per_s * 1e6 if peak_bytes_per_s else None
        gbps = nbytes / us / 1e3 if us else None
        return {"kind": kind, "bytes": nbytes, "us": us, "gb_per_s": gbps,
                "hbm_limit_us": limit_us,
                "hbm_fraction": (limit_us / us) if (us and limit_us) else None,
                "step_share": (us / step_us) if (us is not None and step_us) else None}

    for kind in KINDS:
        rows.append(row(kind, bytes_by_kind.get(kind, 0), us_by_kind.get(kind)))
    rows.append(row("step", sum(bytes_by_kind.values()), step_us))
    return rows


def markdown(rows: list[dict], title: str) -> str:
    def fmt(value, spec: str, scale: float = 1.0) -> str:
        return "-" if value is None else format(value * scale, spec)

    lines = [f"### {title}", "",
             "| kind | MB | µs | GB/s | HBM-limit µs | % of HBM | % of step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['bytes'] / 1e6:.2f} | {fmt(r['us'], '.1f')} | "
                     f"{fmt(r['gb_per_s'], '.0f')} | {fmt(r['hbm_limit_us'], '.1f')} | "
                     f"{fmt(r['hbm_fraction'], '.0f', 100)} | "
                     f"{fmt(r['step_share'], '.0f', 100)} |")
    return "\n".join(lines) + "\n"


def profile_kinds(kernel_us: dict[str, float]) -> dict[str, float]:
    """Per-step kernel µs by name (a profile of the full-graph step) -> µs per
    classified kind: "attention", "other", "linear"."""
    out = {"attention": 0.0, "other": 0.0, "linear": 0.0}
    for name, us in kernel_us.items():
        out[classify_kernel(name)] += us
    return out
