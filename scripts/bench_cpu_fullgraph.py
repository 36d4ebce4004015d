"""Prototype measurement: a CPU decode step of the default packed model (GGUF int4) as ONE
compiled graph, against eager and the piecewise `--compile` (profiles/cpu.md, "Tried: one
compiled graph per CPU decode step"). Not wired into the engine: this script patches
`Attention.attend` so that, while the full graph traces, attention is traceable torch ops
(KV write by index, gather through the block table, masked SDPA with the GQA group folded
into the query axis) and replaces the runner's `forward_fn` with one that sends uniform
decode steps (one query token per request, no padding, one KV-cache group) to
`torch.compile(model, fullgraph=True)` and everything else to the eager model. Each layer
gets K and V caches of its own (the runner's are views of one tensor).

Variants, in one process with their decodes alternating per round (the method of
scripts/bench_cpu_quant.py's interleaved decode): eager (the CPU default), piecewise
(`--compile`), full (the one graph, Inductor's Python wrapper), full_cpp (the same with
Inductor's cpp_wrapper). Step ms = ((steps + 1)-token generate - 1-token generate) / steps.

    OMP_NUM_THREADS=1 VARIANTS=eager,piecewise,full,full_cpp ROUNDS=5 \
        python scripts/bench_cpu_fullgraph.py > out.json
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from llmfast import LLM, SamplingParams
from llmfast.models import decoder as dec
from llmfast.worker.model_runner import ModelRunner

CONTEXT, STEPS = 128, 32
ROUNDS = int(os.environ.get("ROUNDS", "5"))
VARIANTS = os.environ.get("VARIANTS", "eager,piecewise,full,full_cpp").split(",")
FULLGRAPH = {"on": False}  # set while the full graph traces


def decode_attention(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, scale,
                     window):
    """Uniform decode (one query token per request, no padding), traceable torch ops.
    q [B, H, D], k/v [B, KVH, D]; block_table [B, nb]; seq_lens [B] (context incl. new)."""
    num_blocks, block_size, kvh, d = k_cache.shape
    b, h, _ = q.shape
    # index_put_ (not index_copy_): Inductor writes it in place into the cache instead of
    # copying the whole functionalized cache back.
    if os.environ.get("KV_WRITE", "4d") == "op":
        torch.ops.llmfast.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    else:
        block, offset = slot_mapping // block_size, slot_mapping % block_size
        k_cache[block, offset] = k.to(k_cache.dtype)
        v_cache[block, offset] = v.to(v_cache.dtype)
    blocks = block_table.long()
    # [B, nb, bs, KVH, D] -> [B, KVH, L, D]
    keys = k_cache[blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)
    values = v_cache[blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)
    length = keys.shape[2]
    pos = torch.arange(length, device=q.device)
    lens = seq_lens.long()[:, None]
    visible = pos[None, :] < lens
    if window is not None:
        visible = visible & (pos[None, :] >= lens - window)
    mask = torch.where(visible, 0.0, float("-inf")).to(q.dtype)[:, None, None, :]  # [B,1,1,L]
    group = h // kvh
    qg = q.view(b, kvh, group, d)  # the GQA group folded into the query-length axis
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(b, h, d)


_orig_attend = dec.Attention.attend


def attend(self, positions, qkv, attn_metadata):
    if not FULLGRAPH["on"]:
        return _orig_attend(self, positions, qkv, attn_metadata)
    qk, v = self._heads(qkv)
    qk = self.rotary(positions, qk)
    q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
    slot_mapping, block_table = self._tables(attn_metadata)
    out = decode_attention(q, k, v, self.k_cache, self.v_cache, slot_mapping, block_table,
                           attn_metadata.seq_lens, self.scale, self.window)
    return out.reshape(-1, self.q_size)


dec.Attention.attend = attend


def find_runner(llm) -> ModelRunner:
    runner = llm.engine.executor._runner
    assert isinstance(runner, ModelRunner), type(runner)
    return runner


class FullGraphForward:
    """Uniform batch-1..B decode steps without padding -> one compiled graph; else eager."""

    def __init__(self, model, eager_fn, cpp_wrapper: bool):
        self.model, self.eager_fn = model, eager_fn
        options = {"cpp_wrapper": True} if cpp_wrapper else {}
        from llmfast.kernels.layers.triton_ops import register_triton_ops

        register_triton_ops()  # the norms' and RoPE's ops the model records when compiling

        def step(input_ids, positions, md):
            return model(input_ids, positions, md)

        step.__code__ = step.__code__.replace(co_name=f"step_{int(cpp_wrapper)}")
        self.compiled = torch.compile(step, fullgraph=True, dynamic=False, options=options)
        self.calls = {"full": 0, "eager": 0}
        self.first_s = None

    def __call__(self, input_ids, positions, md):
        n = input_ids.shape[0]
        if (md.max_query_len is not None and int(md.max_query_len[0]) == 1
                and md.block_table.shape[0] == n and md.group_block_tables is None):
            self.calls["full"] += 1
            md = dataclasses.replace(md, cpu_step=None, max_query_len=None)
            FULLGRAPH["on"] = True
            try:
                t0 = time.perf_counter()
                out = self.compiled(input_ids, positions, md)
                if self.first_s is None:
                    self.first_s = time.perf_counter() - t0
                return out
            finally:
                FULLGRAPH["on"] = False
        self.calls["eager"] += 1
        return self.eager_fn(input_ids, positions, md)


def make(variant):
    kw = dict(quantization="gguf", max_model_len=CONTEXT + STEPS + 8)
    if variant == "piecewise":
        return LLM(compile=True, **kw), None
    llm = LLM(compile=False, **kw)
    if variant.startswith("full"):
        runner = find_runner(llm)
        if os.environ.get("SEPARATE_CACHES", "1") == "1":
            # One tensor per layer and K/V: the runner's are views of one tensor, and
            # aliased mutated graph inputs make AOTAutograd copy the whole cache back.
            runner.model.bind_kv_caches([(layer.k_cache.clone(), layer.v_cache.clone())
                                         for layer in runner.model.attention_layers()])
        fg = FullGraphForward(runner.model, runner.forward_fn, variant == "full_cpp")
        runner.forward_fn = fg
        return llm, fg
    return llm, None


def main():
    torch.manual_seed(0)
    prompt = list(range(1000, 1000 + CONTEXT))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=STEPS + 1, temperature=0, ignore_eos=True)
    llms, fgs, warm_s, texts = {}, {}, {}, {}
    for v in VARIANTS:
        t0 = time.perf_counter()
        llms[v], fgs[v] = make(v)
        out = llms[v].generate({"prompt_token_ids": prompt}, many)  # warm-up (compiles)
        warm_s[v] = time.perf_counter() - t0
        texts[v] = list(out[0].outputs[0].token_ids) if hasattr(out[0], "outputs") else None
        print(v, "ready in", round(warm_s[v], 1), "s", file=sys.stderr, flush=True)
    times = {v: [] for v in VARIANTS}
    for r in range(ROUNDS):
        for v in VARIANTS:
            llm = llms[v]
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt}, one)
            t1 = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt}, many)
            t2 = time.perf_counter()
            times[v].append(((t2 - t1) - (t1 - t0)) / STEPS * 1e3)
        print("round", r, {v: round(times[v][-1], 2) for v in VARIANTS}, file=sys.stderr,
              flush=True)
    med = {v: statistics.median(times[v]) for v in VARIANTS}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "loadavg_1m": os.getloadavg()[0], "context": CONTEXT, "steps": STEPS,
        "rounds": ROUNDS, "step_ms": times, "step_ms_median": med,
        "vs_eager": {v: med["eager"] / med[v] for v in VARIANTS} if "eager" in med else None,
        "setup_and_first_generate_s": warm_s,
        "fullgraph_calls": {v: fg.calls for v, fg in fgs.items() if fg is not None},
        "fullgraph_first_call_s": {v: fg.first_s for v, fg in fgs.items() if fg is not None},
        "same_greedy_tokens_as_first": {v: texts[v] == texts[VARIANTS[0]] for v in VARIANTS},
    }
    from torch._dynamo.utils import counters
    result["dynamo_counters"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break")}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
