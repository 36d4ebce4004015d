"""The process `llmfast.bench.startup.runs` starts twice: build the engine, make one token,
write the timings as JSON to the file named by the second argument.

    python -m llmfast.cli.startup_child '{"model": ..., "engine_args": {...}}' out.json

In the command's package rather than in `llmfast.bench`, below `LLM`, because it builds
one: it stands for an `llmfast` process. Kept apart from the command's modules so that
`-m` runs a module the package has not imported already (`cli/__init__` imports nothing).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    spec, out = json.loads(argv[1]), Path(argv[2])
    # As the `llmfast` command does first (cli/main.py): this process stands for one.
    from llmfast.utils.bytecode import keep_bytecode
    from llmfast.utils.paths import cache_dir

    keep_bytecode(cache_dir())
    from llmfast.llm import LLM
    from llmfast.sampling_params import SamplingParams

    ready = time.time()
    t0 = time.perf_counter()
    llm = LLM(spec["model"], **spec["engine_args"])
    engine_s = time.perf_counter() - t0
    engine = llm.engine
    vocab = engine.config.model.vocab_size
    prompt = {"prompt_token_ids": [(7 * i + 3) % vocab for i in range(8)]}
    t1 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first_step_s = time.perf_counter() - t1
    first_token = time.time()
    from llmfast.bench.environment import rank_device_facts

    info = engine.runner_info  # rank 0's, wherever it runs
    stats = info.compile_stats  # None: eager
    out.write_text(json.dumps({
        "stages": dict(engine.startup_times),
        "ready_epoch": ready,
        "engine_s": engine_s,
        "first_step_s": first_step_s,
        "first_token_epoch": first_token,
        "compile_cache_hits": stats.cache_hits if stats else 0,
        "compile_cache_misses": stats.cache_misses if stats else 0,
        # Graphs of each kind, capture time and memory (empty in eager mode).
        "compile_summary": stats.summary() if stats else "",
        "triton_variants": info.triton_variants,
        "device": engine.config.device,
        "device_facts": rank_device_facts(info),
        "engine_config": dataclasses.asdict(engine.config),
    }, default=str))


if __name__ == "__main__":
    main(sys.argv)
