"""The engine's host time per decode step, by phase, on a CPU (the model's time left out).

N streaming requests all decoding (the workload of bench_async/run_sweep_point: random
prompts of `--context` tokens, greedy, no EOS); each `engine.step()` is timed on the
thread's CPU clock (`time.thread_time`: time other processes take the core is not
counted) and split with a PhaseTimer into schedule, prepare_inputs, update, detokenize
and the rest of the step (glue: metrics, the output copier, collect). The forward and
the sampler are left out. torch runs on one thread, so the forward runs on this thread
and nowhere else.

The tokenizer is what a random preset carries: the built-in byte-level one (as on the
GPU machine, where the default model is not cached), or with `--tokenizer bpe` a
byte-level BPE trained here (`--bpe-vocab` tokens) installed as the cached default
model's, with the model's vocabulary set to its size, so every sampled id is a token
with text (as with SmolLM2 on random:smollm2-135m). `--vocab` sets the preset's
vocabulary (the GPU run's llama-3.2-1b: 128256; most sampled ids are then outside the
byte-level tokenizer and decode to nothing).

    python scripts/bench_host_phases.py --sizes 1,64,256 --vocab 128256
    python scripts/bench_host_phases.py --sizes 1,64,256 --tokenizer bpe
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HOST_PHASES = ("schedule", "prepare_inputs", "update", "detokenize")


def install_bpe_tokenizer(cache: Path, vocab: int) -> int:
    """A trained byte-level BPE as the cached default model's tokenizer; its size."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llmfast.models.formats.gguf import CONVERSION_VERSION, MARKER_NAME
    from llmfast.models.sources.default_model import DEFAULT_MODEL_NAME
    from tests.helpers.tokenizers import CORPUS, save_hf_tokenizer, train_byte_level_bpe

    rng = np.random.default_rng(0)
    words = " ".join(CORPUS).split()
    corpus = [" ".join(rng.choice(words, 40)) + f" {i} {i * 7919}" for i in range(3000)]
    tok = train_byte_level_bpe(vocab, corpus + CORPUS)
    target = cache / "models" / DEFAULT_MODEL_NAME
    save_hf_tokenizer(tok, target)
    (target / MARKER_NAME).write_text(json.dumps({"format_version": CONVERSION_VERSION}))
    return tok.get_vocab_size()


def make_llm(args, max_seqs: int, vocab: int | None):
    from llmfast import LLM
    from llmfast.models.sources.random_presets import RANDOM_PRESETS

    model = args.model
    if vocab is not None:
        preset = model.removeprefix("random:")
        name = f"{preset}-vocab{vocab}"
        RANDOM_PRESETS[name] = dataclasses.replace(RANDOM_PRESETS[preset], vocab_size=vocab)
        model = f"random:{name}"
    return LLM(model, device="cpu", max_num_seqs=max_seqs,
               max_num_batched_tokens=max(2048, max_seqs * (args.context + 1)),
               max_model_len=args.context + args.steps + 64, enforce_eager=True,
               async_scheduling=args.async_scheduling)


def measure(engine, size: int, args, profile: cProfile.Profile | None) -> dict[str, float]:
    from llmfast.bench.workload import bench_params
    from llmfast.profiling.phase_timing import PhaseTimer

    hold_logits(engine.runner)
    rng = np.random.default_rng([size, args.context])
    vocab = engine.config.model.vocab_size
    params = bench_params(args.steps + 32)
    ids = [engine.add_request({"prompt_token_ids": rng.integers(0, vocab, args.context).tolist()},
                              params, request_id=f"h{size}-{i}") for i in range(size)]
    started: set[str] = set()
    while len(started) < size:
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
    for _ in range(2):
        engine.step()
    timer = PhaseTimer("cpu", clock=time.thread_time)
    engine.set_phase_timer(timer)
    totals = []
    gc_stats = gc.get_stats()
    if args.no_gc:
        gc.disable()
    try:
        for _ in range(args.steps):
            t = time.thread_time()
            if profile is not None:
                profile.enable()
            outs = engine.step()
            if profile is not None:
                profile.disable()
            totals.append(time.thread_time() - t)
            assert len(outs) == size, "not a pure decode step"
    finally:
        gc.enable()
        engine.set_phase_timer(None)
        for req_id in ids:
            engine.abort(req_id)
    per = {name: timer.per_call_ms(name, device=False) for name in
           (*HOST_PHASES, "forward", "sample", "wait_output")}
    row = {name: statistics.median(per[name]) for name in HOST_PHASES}
    model = [f + s for f, s in zip(per["forward"], per["sample"])]
    host = [t * 1e3 - m for t, m in zip(totals, model)]
    row["host"] = statistics.median(host)
    row["gc/step"] = sum(after["collections"] - before["collections"] for before, after in
                         zip(gc_stats, gc.get_stats())) / args.steps
    row["wait_output"] = statistics.median(per["wait_output"])
    row["rest"] = row["host"] - sum(row[name] for name in (*HOST_PHASES, "wait_output"))
    return row


def hold_logits(runner) -> None:
    """Keep each step's logits alive until the next step computes its own, so that their
    free (on a CPU with a 128k vocabulary: 100+ MB given back to the OS, at the end of
    `execute_async`) falls in the sample phase with their allocation; a CUDA caching
    allocator makes both free, and a host phase should not be billed for either."""
    if getattr(runner.model, "_held", None) is not None:
        return
    compute = runner.model.compute_logits
    held: list = [None]

    def compute_logits(hidden):
        held[0] = None
        held[0] = compute(hidden)
        return held[0]

    runner.model.compute_logits = compute_logits
    runner.model._held = held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--vocab", type=int, default=None, help="the preset's vocabulary size")
    ap.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    ap.add_argument("--bpe-vocab", type=int, default=4096)
    ap.add_argument("--sizes", default="1,64,256")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--no-gc", action="store_true",
                    help="the cyclic garbage collector off while timing (to see its share)")
    ap.add_argument("--cprofile", default=None,
                    help="write the cProfile stats of the timed steps of the largest size here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    vocab = args.vocab
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LLMFAST_CACHE"] = tmp
        if args.tokenizer == "bpe":
            vocab = install_bpe_tokenizer(Path(tmp), args.bpe_vocab)
        llm = make_llm(args, max(sizes), vocab)
        engine = llm.engine
        tok = engine.tokenizer
        print(f"# host ms per decode step ({args.model}, vocab {engine.config.model.vocab_size}, "
              f"tokenizer {tok.name if tok else None} ({tok.vocab_size if tok else 0} tokens), "
              f"context {args.context}, {args.steps} steps, "
              f"{'async' if args.async_scheduling else 'sync'}, CPU thread time, "
              f"torch {torch.__version__}, Python {platform.python_version()}, "
              f"{platform.machine()}, {os.cpu_count()} cores)")
        cols = (*HOST_PHASES, "wait_output", "rest", "host", "gc/step")
        print("| requests | " + " | ".join(cols) + " |")
        print("|---:|" + "---:|" * len(cols))
        for size in sizes:
            profile = cProfile.Profile() if args.cprofile and size == max(sizes) else None
            row = measure(engine, size, args, profile)
            print(f"| {size} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |", flush=True)
            if profile is not None:
                profile.dump_stats(args.cprofile)
                pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
