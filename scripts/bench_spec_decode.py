#!/usr/bin/env python3
"""Speculative decoding against plain decode, batch 1, in one run: greedy tokens per
second of each prompt with and without n-gram drafts (interleaved repeats, medians), the
acceptance rate and mean accepted length of the drafts, and whether the two modes emitted
the same tokens (they must: greedy verification keeps the target's argmax).

The prompts are chat messages to the model (its chat template applied): copy-heavy ones
(repeat or edit a given paragraph), where prompt lookup finds long runs, and ordinary
ones, where it finds few. Decode speed counts the tokens after the first over the time
after the first (the prefill is the same work in both modes).

    python scripts/bench_spec_decode.py --json profiles/spec_decode/cpu_smollm2.json
    python scripts/bench_spec_decode.py --k 2,4 --repeats 5 --max-tokens 160

`--mode verify-cost` (the GPU step of scripts/gpu_check.py; random weights, no prompts
needed): the verify step's cost against a plain decode step at each K, with a proposer
that replays the target's own greedy tokens (replay_proposer.py), so every draft is
accepted: the upper bound of the speed-up. Per batch size: the plain step's median time
(synchronous loop, as speculation runs, and the pipelined one), each K's verify step
time and its ratio to the plain step, tokens per verify step, the decode speed-up
end to end; then, for the acceptance rates given (`--acceptance`, e.g. the CPU figures
of real prompts), the speed-up they imply: a step emits (1 - a^(K+1)) / (1 - a) tokens
on average when each draft is accepted with probability a.

    python scripts/bench_spec_decode.py --mode verify-cost --model random:llama-3.2-1b \
        --dtype bfloat16 --device cuda --k 1,2,4,8 --batch-sizes 1,8 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from llmfast import LLM, SamplingParams  # noqa: E402

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "small brass lantern and a notebook. At the top he cleaned the great lens, checked "
    "the clockwork that turned it, and wrote down the weather: the direction of the "
    "wind, the height of the waves, and the ships he could see on the horizon. In "
    "thirty years he had missed only two evenings, both during the storm of 1953.")
TYPOS = PARAGRAPH.replace("climbed", "climed").replace("notebook", "notebok").replace(
    "weather", "wether").replace("horizon", "horizn")
PROMPTS = {
    # copy-heavy
    "repeat": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "fix_typos": f"Fix the spelling mistakes in this paragraph and write it out in full:"
                 f"\n\n{TYPOS}",
    "past_to_present": f"Rewrite this paragraph in the present tense:\n\n{PARAGRAPH}",
    # ordinary
    "capital": "What is the capital of France? Answer in two sentences.",
    "python": "Write a Python function that returns the n-th Fibonacci number.",
    "explain": "Explain in a short paragraph why the sky is blue.",
}
COPY_HEAVY = ("repeat", "fix_typos", "past_to_present")
MEASURED_COMMIT = "unknown"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("prompts", "verify-cost"), default="prompts")
    p.add_argument("--model", default=None, help="default: llmfast's default model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: the engine's for the device")
    p.add_argument("--batch-sizes", default="1", help="verify-cost: requests at once")
    p.add_argument("--context", type=int, default=256, help="verify-cost: prompt tokens")
    p.add_argument("--acceptance", default="0.5,0.7,0.9",
                   help="verify-cost: acceptance rates to turn into expected speed-ups")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--k", default="3", help="drafts per step to try, e.g. 2,4")
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--quantization", default=None,
                   help="the engine flag (none: a GGUF's weights dequantized to --dtype)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and mode")
    p.add_argument("--prompts", default=",".join(PROMPTS))
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def timed_generate(llm: LLM, prompt_ids: list[int], max_tokens: int) -> dict:
    """One greedy request alone, stepped to its end; times of its first and last token."""
    engine = llm.engine
    before = engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt_ids}, params)
    first = None
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    end = time.perf_counter()
    after = engine.stats()
    n = len(tokens)
    return {
        "tokens": tokens,
        "num_tokens": n,
        "e2e_tok_s": n / (end - t0),
        "decode_tok_s": (n - 1) / (end - first) if n > 1 and end > first else None,
        "drafts": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
        "accepted": after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
        "verify_steps": after.spec_num_verify_steps - before.spec_num_verify_steps,
    }


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                       text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    args = parse_args()
    global MEASURED_COMMIT
    MEASURED_COMMIT = git_commit()  # the tree imported now, not the HEAD at the end
    if args.mode == "verify-cost":
        return verify_cost_main(args)
    ks = [int(k) for k in args.k.split(",")]
    names = [n.strip() for n in args.prompts.split(",")]
    common = dict(device=args.device, seed=0)
    if args.model:
        common["model"] = args.model
    if args.quantization:
        common["quantization"] = args.quantization
    modes = {"plain": LLM(**common)}
    for k in ks:
        modes[f"ngram_k{k}"] = LLM(**common, speculative_method="ngram",
                                   num_speculative_tokens=k,
                                   ngram_prompt_lookup_max=args.ngram_max)
    tokenizer = modes["plain"].engine.tokenizer
    prompt_ids = {n: tokenizer.chat_prompt([{"role": "user", "content": PROMPTS[n]}], True)[1]
                  for n in names}
    for llm in modes.values():  # warm-up: first-step allocations, thread pools
        timed_generate(llm, prompt_ids[names[0]], 8)
    results: dict[str, dict[str, list[dict]]] = {n: {m: [] for m in modes} for n in names}
    for rep in range(args.repeats):
        for n in names:
            # Interleaved: a slow spell of the shared machine hits every mode alike.
            for m, llm in modes.items():
                r = timed_generate(llm, prompt_ids[n], args.max_tokens)
                results[n][m].append(r)
                print(f"[{rep}] {n:16s} {m:10s} {r['num_tokens']:4d} tok "
                      f"{r['decode_tok_s'] or 0:6.1f} tok/s decode, accepted "
                      f"{r['accepted']}/{r['drafts']}", file=sys.stderr)
    report = summarize(results, names, list(modes))
    report["config"] = {"model": modes["plain"].engine.source.name, "device": args.device,
                        "quantization": modes["plain"].engine.config.quantization,
                        "k": ks, "ngram_prompt_lookup_max": args.ngram_max,
                        "max_tokens": args.max_tokens, "repeats": args.repeats,
                        "batch_size": 1, "greedy": True, "prompts": {n: PROMPTS[n] for n in names},
                        "prompt_tokens": {n: len(prompt_ids[n]) for n in names}}
    print_table(report, list(modes))
    write_report(report, args.json)


def write_report(report: dict, path: Path | None) -> None:
    report["environment"] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": MEASURED_COMMIT, "torch": torch.__version__, "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)


# ---------------------------------------------------------------------- verify cost


def decode_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once, greedy, `max_tokens` each: the wall time of every step while
    every request decodes (after the prefill step), and the tokens."""
    engine = llm.engine
    before = engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = {engine.add_request({"prompt_token_ids": p}, params, stream=False): i
           for i, p in enumerate(prompts)}
    tokens: dict[int, list[int]] = {}
    step_s, t_first = [], None
    while engine.has_unfinished():
        all_decoding = t_first is not None and engine.stats().num_running_reqs == len(prompts)
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                tokens[ids[out.request_id]] = list(out.outputs[0].token_ids)
        t1 = time.perf_counter()
        if t_first is None:
            t_first = t1  # the prefill step (every prompt fits the budget)
        elif all_decoding:
            step_s.append(t1 - t0)
    end = time.perf_counter()
    if engine.async_scheduling:
        step_s = step_s[1:]  # the first pipelined step collects the prefill's outputs
    after = engine.stats()
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    steps = after.spec_num_verify_steps - before.spec_num_verify_steps
    out_tokens = sum(len(t) for t in tokens.values())
    return {"tokens": [tokens[i] for i in range(len(prompts))],
            "median_step_ms": statistics.median(step_s) * 1e3 if step_s else None,
            "num_steps_timed": len(step_s),
            "decode_tok_s": (out_tokens - len(prompts)) / (end - t_first),
            "acceptance_rate": accepted / drafts if drafts else None,
            "tokens_per_verify_step": (accepted + steps) / steps if steps else None}


def _release(llm: LLM) -> None:
    import gc

    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def verify_cost_main(args: argparse.Namespace) -> None:
    from llmfast.worker.spec_decode.replay_proposer import ReplayProposer

    ks = [int(k) for k in args.k.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    alphas = [float(a) for a in args.acceptance.split(",")]
    base = dict(model=args.model, device=args.device, seed=0,
                max_model_len=args.context + args.max_tokens + max(ks) + 8,
                max_num_seqs=max(sizes), max_num_batched_tokens=max(
                    max(sizes) * args.context, max(sizes) * (max(ks) + 1), 256))
    if args.dtype:
        base["dtype"] = args.dtype
    if args.device.startswith("cuda"):
        base["gpu_memory_utilization"] = args.gpu_memory_utilization
    rng = __import__("random").Random(0)
    llm = LLM(**base)
    vocab = llm.engine.config.model.vocab_size
    prompts = {b: [[rng.randrange(100, vocab) for _ in range(args.context)] for _ in range(b)]
               for b in sizes}
    plain, sequences = {}, {}
    for b in sizes:
        decode_run(llm, prompts[b][:1], 4)  # warm-up
        llm.engine.set_async_scheduling(False)
        sync = decode_run(llm, prompts[b], args.max_tokens)
        llm.engine.set_async_scheduling(args.device.startswith("cuda"))
        piped = decode_run(llm, prompts[b], args.max_tokens)
        plain[b] = {"sync": {k: v for k, v in sync.items() if k != "tokens"},
                    "async": {k: v for k, v in piped.items() if k != "tokens"}}
        sequences[b] = [p + t for p, t in zip(prompts[b], sync["tokens"])]
        print(f"B={b} plain: {sync['median_step_ms']:.2f} ms/step sync, "
              f"{piped['median_step_ms']:.2f} ms pipelined", file=sys.stderr)
    _release(llm)
    per_k = {}
    for k in ks:
        llm = LLM(**base, speculative_method="ngram", num_speculative_tokens=k)
        per_k[k] = {}
        for b in sizes:
            llm.engine.runner.spec.proposer = ReplayProposer(k, sequences[b])
            decode_run(llm, prompts[b][:1], 4)  # warm-up
            run = decode_run(llm, prompts[b], args.max_tokens)
            p = plain[b]["sync"]
            cost = run["median_step_ms"] / p["median_step_ms"] if run["median_step_ms"] else None
            entry = {key: v for key, v in run.items() if key != "tokens"}
            entry |= {"verify_cost_vs_plain_step": cost,
                      "same_tokens_as_plain": run["tokens"] == [
                          s[args.context:] for s in sequences[b]],
                      "decode_speedup_vs_sync": run["decode_tok_s"] / p["decode_tok_s"],
                      "decode_speedup_vs_async": run["decode_tok_s"]
                      / plain[b]["async"]["decode_tok_s"]}
            if cost:
                entry["expected_speedup_at_acceptance"] = {
                    str(a): (sum(a**i for i in range(k + 1))) / cost for a in alphas}
            per_k[k][b] = entry
            print(f"K={k} B={b}: verify {run['median_step_ms']:.2f} ms = {cost:.2f}x a plain "
                  f"step, {run['tokens_per_verify_step']:.2f} tokens/step, acceptance "
                  f"{run['acceptance_rate']:.2f}, {entry['decode_speedup_vs_sync']:.2f}x "
                  "decode tok/s", file=sys.stderr)
        _release(llm)
    report = {"config": {"mode": "verify-cost", "model": args.model, "device": args.device,
                         "dtype": args.dtype, "k": ks, "batch_sizes": sizes,
                         "context": args.context, "max_tokens": args.max_tokens,
                         "acceptance": alphas},
              "plain": {str(b): v for b, v in plain.items()},
              "verify": {str(k): {str(b): e for b, e in v.items()} for k, v in per_k.items()}}
    write_report(report, args.json)


def summarize(results, names, modes) -> dict:
    per_prompt = {}
    for n in names:
        entry = {}
        plain_tokens = results[n]["plain"][0]["tokens"]
        for m in modes:
            runs = results[n][m]
            drafts = sum(r["drafts"] for r in runs)
            accepted = sum(r["accepted"] for r in runs)
            steps = sum(r["verify_steps"] for r in runs)
            entry[m] = {
                "decode_tok_s": [r["decode_tok_s"] for r in runs],
                "e2e_tok_s": [r["e2e_tok_s"] for r in runs],
                "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                "median_e2e_tok_s": statistics.median(r["e2e_tok_s"] for r in runs),
                "num_tokens": runs[0]["num_tokens"],
                "same_tokens_as_plain": all(r["tokens"] == plain_tokens for r in runs),
                "acceptance_rate": accepted / drafts if drafts else None,
                "mean_accepted_length": (accepted + steps) / steps if steps else None,
            }
            if m != "plain":
                entry[m]["decode_speedup"] = (entry[m]["median_decode_tok_s"]
                                              / entry["plain"]["median_decode_tok_s"])
        per_prompt[n] = entry
    summary = {}
    for m in modes:
        if m == "plain":
            continue
        copy = [per_prompt[n][m]["decode_speedup"] for n in names if n in COPY_HEAVY]
        other = [per_prompt[n][m]["decode_speedup"] for n in names if n not in COPY_HEAVY]
        summary[m] = {"copy_heavy_median_speedup": statistics.median(copy) if copy else None,
                      "ordinary_median_speedup": statistics.median(other) if other else None}
    return {"per_prompt": per_prompt, "summary": summary}


def print_table(report, modes) -> None:
    print(f"{'prompt':16s} " + " ".join(f"{m:>22s}" for m in modes))
    for n, entry in report["per_prompt"].items():
        cells = []
        for m in modes:
            e = entry[m]
            cell = f"{e['median_decode_tok_s']:.1f}"
            if m != "plain":
                acc = e["acceptance_rate"]
                cell += (f" {e['decode_speedup']:.2f}x a{acc:.2f}" if acc is not None
                         else f" {e['decode_speedup']:.2f}x")
                if not e["same_tokens_as_plain"]:
                    cell += " DIFF"
            cells.append(f"{cell:>22s}")
        print(f"{n:16s} " + " ".join(cells))
    for m, s in report["summary"].items():
        print(f"{m}: copy-heavy median speed-up {s['copy_heavy_median_speedup']:.2f}x, "
              f"ordinary {s['ordinary_median_speedup']:.2f}x")


if __name__ == "__main__":
    main()
