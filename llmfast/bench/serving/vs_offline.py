"""`llmfast serve` against offline `LLM.generate` on the same prompts: the offline side's
figures per stream count and the table of the two side by side (scripts/bench_serve.py
--vs-offline, --cpu-bar, --gpu-bar run them and start the servers).

A workload `spec` is a dict: model, input_len, output_len, vocab_size, serve_args (the
engine's flags, as `llmfast serve` takes them), streams (the stream counts) and seed.
The offline TPOT p50 is the engine's decode step at that batch (every request decodes in
every step), the figure the GPU bar compares the server's TPOT with.
"""

from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from llmfast.bench.stats import summarize
from llmfast.bench.workload import BenchRequest, random_requests


def spec_requests(spec: dict, streams: int) -> list[BenchRequest]:
    """`streams` requests of the workload's fixed lengths (the same for both sides)."""
    return random_requests(streams, spec["input_len"], spec["output_len"],
                           spec["vocab_size"], 0.0, spec["seed"])


def offline_rows(llm, spec: dict) -> list[dict]:
    """Every stream count's offline figures on `llm` (an `LLM` built with the workload's
    serve_args; a warm-up of 4 streams first): output tok/s, TTFT and TPOT p50 and p99
    in ms."""
    from llmfast.sampling_params import SamplingParams

    def generate(requests):
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                  for r in requests]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                            params)
        return outs, time.perf_counter() - start

    rows = []
    # In a worker thread, as the server's engine steps (torch's main-thread team was many
    # times slower on an oversubscribed VM: profiles/serving.md).
    with ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(generate, spec_requests(spec, 4)).result()  # warm-up
        for streams in spec["streams"]:
            outs, wall = worker.submit(generate, spec_requests(spec, streams)).result()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            ttft = summarize([o.metrics.ttft for o in outs])
            tpot = summarize([o.metrics.tpot for o in outs if o.metrics.tpot is not None])
            rows.append({"streams": streams, "duration_s": wall, "out_tok_s": tokens / wall,
                         "ttft_p50_ms": ttft.median * 1e3, "ttft_p99_ms": ttft.p99 * 1e3,
                         "tpot_p50_ms": tpot.median * 1e3, "tpot_p99_ms": tpot.p99 * 1e3})
    return rows


def vs_offline_table(rows: list[dict], streams: list[int], api_servers: list,
                     bars: dict) -> str:
    """Markdown: medians over the repeats; serve/offline is the median of each repeat's
    ratio, judged against `bars` ({streams: least ratio})."""
    def med(what, n, key):
        vals = [r[key] for r in rows if r["what"] == what and r["streams"] == n]
        return statistics.median(vals) if vals else math.nan

    lines = ["| run | streams | out tok/s | serve/offline | bar | TTFT p50 ms | TTFT p99 ms "
             "| TPOT p50 ms | TPOT p99 ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    whats = ["offline"] + ["serve" if a is None else f"serve --api-servers {a}"
                           for a in api_servers]
    for n in streams:
        offline = {r["repeat"]: r["out_tok_s"] for r in rows
                   if r["what"] == "offline" and r["streams"] == n}
        for what in whats:
            ratio, bar = "", ""
            if what != "offline":
                ratios = [r["out_tok_s"] / offline[r["repeat"]] for r in rows
                          if r["what"] == what and r["streams"] == n and r["repeat"] in offline]
                ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
                if n in bars and ratios:
                    bar = f"{bars[n]} {'ok' if statistics.median(ratios) >= bars[n] else 'MISSED'}"
            lines.append(f"| {what} | {n} | {med(what, n, 'out_tok_s'):.0f} | {ratio} | {bar} | "
                         f"{med(what, n, 'ttft_p50_ms'):.0f} | {med(what, n, 'ttft_p99_ms'):.0f} | "
                         f"{med(what, n, 'tpot_p50_ms'):.2f} | {med(what, n, 'tpot_p99_ms'):.2f} |")
    return "\n".join(lines)
