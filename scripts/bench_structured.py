"""Structured outputs, two measurements (subcommands):

- `backends`: the two grammar engines on a tokenizer: compile time of a nested JSON
  schema (cold, no cache) and the per-step mask fill time along a valid output. Medians
  of repeats; the matcher is driven by the same token sequence for both engines (the
  tokenization of one valid document), one fill per token, as decoding does.
- `cost`: what a JSON-schema constraint costs in decode throughput: tok/s at batch 1 and
  64 with the constraint and without, in one run, medians of repeats. The schema cannot
  end within max_tokens (an array of at least 100 objects), so every step of every
  constrained row fills and applies a mask; ignore_eos keeps the plain rows as long.
  Each batch size runs both modes back to back, after a warm-up of each (the grammar's
  compile, the first steps' allocations), alternating plain and constrained repeats so a
  machine's drift hits both alike.

    PYTHONPATH=. python scripts/bench_structured.py backends --tokenizer DIR --out FILE.json
    PYTHONPATH=. python scripts/bench_structured.py cost --model default --device cpu \
        --out profiles/structured/cost-cpu.json
    # GPU (the <= 10 % bar at batch 64):
    PYTHONPATH=. python scripts/bench_structured.py cost --model random:llama-3.2-1b \
        --device cuda --max-tokens 256 --out OUT.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import subprocess
import time

# `backends`: a nested schema and one valid document of it.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
NESTED_DOC = {"name": "Alice", "age": 31, "role": "admin",
              "address": {"street": "1 Main St", "city": "Paris", "zip": "75001"},
              "tags": ["a", "bb"], "scores": [1.5, 2.0]}
# `cost`: a schema that cannot end within max_tokens.
ARRAY_SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}
PROMPT = "List the users of the system as a JSON array of objects with id, name and ok."


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def _time_calls(call, n: int) -> list[float]:
    """Seconds of each of `n` calls of `call`."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def _report(tok_s: float, compile_s: list[float], fills: list[float],
            apply_s: list[float]) -> dict:
    """One backend's figures, the same keys for both (backends.json)."""
    return {"tokenizer_info_ms": round(tok_s * 1e3, 1),
            "compile_ms_median": _median_ms(compile_s),
            "compile_ms": [round(s * 1e3, 2) for s in compile_s],
            "fill_ms_median": _median_ms(fills),
            "fill_ms_mean": round(statistics.mean(fills) * 1e3, 4),
            "fill_ms_max": round(max(fills) * 1e3, 3),
            "apply_batch64_cpu_ms_median": _median_ms(apply_s)}


def measure_xgrammar(hf_tok, tokens: list[int], repeats: int) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok))
    tok_s = time.perf_counter() - t0
    compile_s = []
    for _ in range(repeats):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(NESTED_SCHEMA))
        compile_s.append(time.perf_counter() - t0)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    fills = []
    for _ in range(repeats):
        m = xgr.GrammarMatcher(compiled)
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            fills.append(time.perf_counter() - t0)
            assert m.accept_token(t), t
    logits = torch.randn(64, info.vocab_size)
    mask64 = xgr.allocate_token_bitmask(64, info.vocab_size)
    apply_s = _time_calls(lambda: xgr.apply_token_bitmask_inplace(logits, mask64), repeats * 5)
    return _report(tok_s, compile_s, fills, apply_s)


def measure_llguidance(hf_tok, tokens: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    import torch

    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(hf_tok)
    tok_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(NESTED_SCHEMA))
    compile_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(ll_tok, grammar)
        # llguidance compiles lazily: the first mask pays for the lexer's start.
        bitmask = lt.allocate_token_bitmask(1, ll_tok.vocab_size)
        lt.fill_next_token_bitmask(m, bitmask, 0)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
    fills = []
    for _ in range(repeats):
        m = llguidance.LLMatcher(ll_tok, grammar)
        for t in tokens:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, bitmask, 0)
            fills.append(time.perf_counter() - t0)
            assert m.consume_token(t), (t, m.get_error())
    logits = torch.randn(64, ll_tok.vocab_size)
    mask64 = lt.allocate_token_bitmask(64, ll_tok.vocab_size)
    apply_s = _time_calls(lambda: lt.apply_token_bitmask_inplace(logits, mask64), repeats * 5)
    return _report(tok_s, compile_s, fills, apply_s)


def _stamp() -> dict:
    """The measured tree and the date, as every figure has."""
    return {"tree": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                   capture_output=True, text=True).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def backends(args) -> dict:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(args.tokenizer)
    tokens = hf_tok.encode(json.dumps(NESTED_DOC), add_special_tokens=False)
    result = {
        "tokenizer": args.tokenizer, "vocab_size": len(hf_tok), "doc_tokens": len(tokens),
        "repeats": args.repeats, "machine": platform.processor() or platform.machine(),
        **_stamp(),
        "xgrammar": {"version": importlib.metadata.version("xgrammar"),
                     **measure_xgrammar(hf_tok, tokens, args.repeats)},
        "llguidance": {"version": importlib.metadata.version("llguidance"),
                       **measure_llguidance(hf_tok, tokens, args.repeats)},
    }
    print(json.dumps(result, indent=2))
    return result


def cost(args) -> dict:
    import torch

    from llmfast import LLM, SamplingParams
    from llmfast.structured_params import StructuredOutputs

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, device=args.device, max_num_seqs=max(batches))
    spec = StructuredOutputs(json=ARRAY_SCHEMA)
    modes = {"plain": None, "json_schema": spec}

    def run(batch: int, structured) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                structured=structured)
        t0 = time.perf_counter()
        outs = llm.generate([PROMPT] * batch, params)
        elapsed = time.perf_counter() - t0
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)

    results = {}
    for batch in batches:
        samples = {m: [] for m in modes}
        for m, s in modes.items():  # warm-up: compile, first allocations
            run(batch, s)
        for _ in range(args.repeats):
            for m, s in modes.items():
                elapsed, tokens = run(batch, s)
                samples[m].append(tokens / elapsed)
        med = {m: statistics.median(v) for m, v in samples.items()}
        results[str(batch)] = {
            "tok_s_median": {m: round(v, 1) for m, v in med.items()},
            "tok_s_samples": {m: [round(x, 1) for x in v] for m, v in samples.items()},
            "json_schema_over_plain": round(med["json_schema"] / med["plain"], 3),
        }
        print(f"batch {batch:3d}: plain {med['plain']:8.1f} tok/s, json_schema "
              f"{med['json_schema']:8.1f} tok/s, ratio {med['json_schema'] / med['plain']:.3f}",
              flush=True)
    return {
        "what": "decode tok/s with a JSON-schema constraint against without",
        "model": args.model, "device": args.device, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "schema": ARRAY_SCHEMA, "results": results,
        "torch": torch.__version__, "machine": platform.machine(), **_stamp(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("backends", help="xgrammar against llguidance: compile and fill")
    b.add_argument("--tokenizer", required=True)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--out")
    c = sub.add_parser("cost", help="decode tok/s with a JSON schema against without")
    c.add_argument("--model", default="default")
    c.add_argument("--device", default="cpu")
    c.add_argument("--batches", default="1,64")
    c.add_argument("--max-tokens", type=int, default=32)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--out")
    args = ap.parse_args()
    result = backends(args) if args.what == "backends" else cost(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
