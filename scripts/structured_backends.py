"""Compare the two grammar engines on the default model's tokenizer: compile time of a
nested JSON schema (cold, no cache) and the per-step mask fill time along a valid output.

    PYTHONPATH=. python scripts/structured_backends.py --tokenizer DIR --out FILE.json

Medians of repeats; the matcher is driven by the same token sequence for both engines
(the tokenization of one valid document), one fill per token, as decoding does.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import subprocess
import time

SCHEMA = {
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
DOC = {"name": "Alice", "age": 31, "role": "admin",
       "address": {"street": "1 Main St", "city": "Paris", "zip": "75001"},
       "tags": ["a", "bb"], "scores": [1.5, 2.0]}


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
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
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
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(args.tokenizer)
    tokens = hf_tok.encode(json.dumps(DOC), add_special_tokens=False)
    result = {
        "tokenizer": args.tokenizer, "vocab_size": len(hf_tok), "doc_tokens": len(tokens),
        "repeats": args.repeats, "machine": platform.processor() or platform.machine(),
        "tree": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "xgrammar": {"version": importlib.metadata.version("xgrammar"),
                     **measure_xgrammar(hf_tok, tokens, args.repeats)},
        "llguidance": {"version": importlib.metadata.version("llguidance"),
                       **measure_llguidance(hf_tok, tokens, args.repeats)},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
