"""Prefill, mixed-batch and tile-tuning rows of scripts/bench_kernels.py (CUDA), and their
markdown tables.

- Prefill: one request of T fresh tokens, causal, against torch SDPA pinned to its
  FlashAttention backend; eager and replayed from a CUDA graph, both sides; our kernel
  with its tuned tiles and with the untuned heuristic; TFLOP/s on the causal half
  (2 * T^2 * heads * head_dim).
- Mixed: one chunk of C tokens over a P-token cached prefix plus D decodes at context L,
  as ONE launch, against the same two parts launched separately (the chunk alone, the
  decodes alone), eager and graph-replayed.
- Tuning: the prefill tile search of llmfast/kernels/tuning/prefill_tuning.py for the bench's
  shape classes (causal and mixed), its per-candidate times, and the table it wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from llmfast.attention.triton import launch as attention
from llmfast.attention.tuning import prefill_tuning
from llmfast.attention.tuning.prefill_tuning import ShapeClass, heuristic_tiles
from llmfast.attention.workspaces import AttentionWorkspaces
from llmfast.bench.kernels.attention_inputs import flash_backend, paged_copy, sdpa_flash
from llmfast.bench.kernels.cuda_timing import graph_replay, max_diff_ulps, time_us


def tune(args, device: torch.device) -> dict:
    """Tune (mode "force": afresh; "auto": only classes without tiles) the bench's two
    shape classes; the tuned table is copied to args.tuned_table when given."""
    group = args.num_heads // args.num_kv_heads
    result = {}
    for kind in ("causal", "mixed"):
        cls = ShapeClass(args.head_dim, group, args.dtype, kind)
        tiles = attention.tune_prefill_tiles(device, cls, force=args.tune == "force")
        result[cls.key] = None if tiles is None else prefill_tuning.candidate_name(tiles)
    path = prefill_tuning.tuned_table_path(torch.cuda.get_device_name(device))
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if args.tuned_table and path.is_file():
        shutil.copyfile(path, args.tuned_table)
    return dict(chosen=result, table_path=str(path), table=saved)


def run_prefill(tokens: int, args, flush, gen) -> dict:
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, hd = args.num_heads, args.num_kv_heads, args.head_dim
    q = torch.randn(1, tokens, heads, hd, dtype=dtype, device="cuda", generator=gen)
    k = torch.randn(1, tokens, kv_heads, hd, dtype=dtype, device="cuda", generator=gen)
    v = torch.randn(1, tokens, kv_heads, hd, dtype=dtype, device="cuda", generator=gen)
    k_cache, v_cache, table = paged_copy(k, v, args.block_size, gen)
    workspaces = AttentionWorkspaces([k_cache])  # noqa: F841 - held while the calls run
    q_flat, scale = q.view(tokens, heads, hd), hd**-0.5
    out = torch.empty_like(q_flat)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")

    def ours(tiles=None):
        attention.unified_attention(q_flat, k_cache, v_cache, table, qsl, seq_lens, scale, out,
                                    prefill_tiles=tiles)

    untuned = heuristic_tiles(hd, dtype)
    q_s, k_s, v_s = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    sdpa, variant = sdpa_flash(q_s, k_s, v_s, True, scale)
    flops = 2 * tokens * tokens * heads * hd
    r = dict(tokens=tokens, sdpa_variant=variant,
             ours_us=time_us(ours, args.iters, flush, idle=True),
             untuned_us=time_us(lambda: ours(untuned), args.iters, flush, idle=True),
             ours_graph_us=time_us(graph_replay(ours), args.iters, flush))
    with flash_backend():
        r["sdpa_us"] = time_us(sdpa, args.iters, flush, idle=True)
        r["sdpa_graph_us"] = time_us(graph_replay(sdpa), args.iters, flush)
        want = sdpa().float()
    out.fill_(float("nan"))
    ours()
    got = out.view(1, tokens, heads, hd).transpose(1, 2).float()
    r["max_abs_diff"] = (got - want).abs().max().item()
    r["max_diff_ulps"] = max_diff_ulps(got, want, dtype)
    for name in ("ours", "untuned", "ours_graph", "sdpa", "sdpa_graph"):
        r[f"{name}_tflops"] = flops / r[f"{name}_us"] / 1e6
    return r


def run_mixed(chunk: int, prefix: int, decodes: int, ctx: int, args, flush, gen) -> dict:
    """Request 0: `chunk` new tokens after `prefix` cached ones; requests 1..decodes: one
    new token each at context `ctx`."""
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, hd = args.num_heads, args.num_kv_heads, args.head_dim
    length = max(prefix + chunk, ctx)
    k = torch.randn(1 + decodes, length, kv_heads, hd, dtype=dtype, device="cuda", generator=gen)
    v = torch.randn_like(k)
    k_cache, v_cache, table = paged_copy(k, v, args.block_size, gen)
    workspaces = AttentionWorkspaces([k_cache])  # noqa: F841 - held while the calls run
    q = torch.randn(chunk + decodes, heads, hd, dtype=dtype, device="cuda", generator=gen)
    scale = hd**-0.5
    i32 = dict(dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, *range(chunk, chunk + decodes + 1)], **i32)
    seq_lens = torch.tensor([prefix + chunk] + [ctx] * decodes, **i32)
    out_mixed, out_parts = torch.empty_like(q), torch.empty_like(q)
    chunk_qsl = torch.tensor([0, chunk], **i32)
    decode_qsl = torch.arange(decodes + 1, **i32)

    def mixed():
        attention.unified_attention(q, k_cache, v_cache, table, qsl, seq_lens, scale, out_mixed)

    def parts():
        attention.unified_attention(q[:chunk], k_cache, v_cache, table[:1], chunk_qsl,
                                    seq_lens[:1], scale, out_parts[:chunk])
        attention.unified_attention(q[chunk:], k_cache, v_cache, table[1:], decode_qsl,
                                    seq_lens[1:], scale, out_parts[chunk:])

    r = dict(chunk=chunk, prefix=prefix, decodes=decodes, ctx=ctx,
             mixed_us=time_us(mixed, args.iters, flush, idle=True),
             parts_us=time_us(parts, args.iters, flush, idle=True),
             mixed_graph_us=time_us(graph_replay(mixed), args.iters, flush),
             parts_graph_us=time_us(graph_replay(parts), args.iters, flush))
    mixed()
    parts()
    r["max_abs_diff_vs_parts"] = (out_mixed.float() - out_parts.float()).abs().max().item()
    return r


def prefill_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "", "Prefill (one request, causal; TFLOP/s on 2 * T^2 * heads * head_dim; SDPA = "
        f"{rows[0]['sdpa_variant'] if rows else 'flash'}):", "",
        "| tokens | llmfast µs | TFLOP/s | / SDPA | untuned tiles µs | graph µs | graph TFLOP/s "
        "| graph / SDPA graph | SDPA µs | SDPA TFLOP/s | SDPA graph µs | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['ours_us']:.1f} | {r['ours_tflops']:.0f} "
            f"| {r['sdpa_us'] / r['ours_us']:.2f}x | {r['untuned_us']:.1f} "
            f"| {r['ours_graph_us']:.1f} | {r['ours_graph_tflops']:.0f} "
            f"| {r['sdpa_graph_us'] / r['ours_graph_us']:.2f}x | {r['sdpa_us']:.1f} "
            f"| {r['sdpa_tflops']:.0f} | {r['sdpa_graph_us']:.1f} | {r['max_abs_diff']:.2g} |")
    return lines


def mixed_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "", "Mixed batch (a chunk over a cached prefix + decodes) in one launch vs its two parts "
        "launched separately:", "",
        "| chunk | prefix | decodes | decode ctx | one launch µs | two parts µs | parts / one "
        "| one graph µs | parts graph µs | parts / one (graph) | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['chunk']} | {r['prefix']} | {r['decodes']} | {r['ctx']} "
            f"| {r['mixed_us']:.1f} | {r['parts_us']:.1f} | {r['parts_us'] / r['mixed_us']:.2f}x "
            f"| {r['mixed_graph_us']:.1f} | {r['parts_graph_us']:.1f} "
            f"| {r['parts_graph_us'] / r['mixed_graph_us']:.2f}x "
            f"| {r['max_abs_diff_vs_parts']:.2g} |")
    return lines


def tuning_lines(tuning: dict) -> list[str]:
    lines = ["", f"Prefill tile tuning (table: {tuning['table_path']}; µs per candidate on "
             "the synthetic batch of llmfast/kernels/tuning/prefill_measure.py):", ""]
    for key, chosen in tuning["chosen"].items():
        entry = tuning["table"].get("tiles", {}).get(key, {})
        timings = entry.get("timings_us", {})
        lines.append(f"- {key}: **{chosen or 'heuristic (no candidate ran)'}**; "
                     + ", ".join(f"{name} {us:.0f}" for name, us in
                                 sorted(timings.items(), key=lambda kv: kv[1])))
    return lines


def tuned_table_note(path: Path | None) -> list[str]:
    if path is None:
        return []
    return ["", f"Tuned table copied to {path}: copy it to llmfast/kernels/tuning/prefill_tables/"
            "<gpu slug>.json to ship it as this GPU's default."]
