"""The executor's cost per step: the engine's decode step time (median of `engine.step()`,
in the synchronous loop and in the pipelined one, `--loops`) with the model in this
process (`uni`) against worker processes (`mp` with 1 and 2 tensor-parallel ranks; `ray`
on request), per batch size, side by side in one run; and the gloo all-reduce that
tensor parallelism adds to every layer, timed alone.

`mp` TP=1 runs the same model with the same threads as `uni` in one worker process:
their difference is the executor's inter-process overhead per step (one pickled step
written to each worker, which also asks for the oldest step's tokens, and rank 0's tokens
back). The engines are all started first and measured in turn, `--repeats` rounds, so
each sees the same machine state. The backend `mp-2msg` is `mp` with the engine's
`then_collect` hint dropped: every step then costs two messages per worker (the step, a
separate COLLECT), the protocol before 2026-11-23, so one run compares both. In
brackets after each median: the CPU time of this process and its worker processes per
engine step (mean over all steps of the sweep points, prefill included), which other
jobs on a shared machine disturb far less than the wall time.

    PYTHONPATH=$PWD python scripts/bench_executor.py --model random:tiny --threads 1
    PYTHONPATH=$PWD python scripts/bench_executor.py --model random:smollm2-135m
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import multiprocessing
import os
import statistics
import time

import torch

from llmfast import LLM
from llmfast.bench import environment_info, rank_device_facts, run_sweep_point, warm_up
from llmfast.bench.stats import median_call_ms


WARMUP_STEPS = 2


def _all_reduce_rank(rank: int, world: int, port: int, shapes, calls: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    medians = {}
    for shape in shapes:
        x = torch.randn(*shape)
        medians[shape] = median_call_ms(lambda: dist.all_reduce(x), calls, warmup=10)
    if rank == 0:
        results.put(medians)
    dist.destroy_process_group()


def all_reduce_ms(world: int, shapes: list[tuple[int, int]], calls: int = 200
                  ) -> dict[tuple[int, int], float]:
    """Median gloo all-reduce time (ms) of a float32 tensor of each shape, `world` ranks."""
    from llmfast.utils.ports import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, world, port, shapes, calls, results))
             for r in range(world)]
    for p in procs:
        p.start()
    medians = results.get(timeout=300)
    for p in procs:
        p.join()
    return medians


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds the processes' threads have run so far (/proc/PID/task/*/schedstat,
    nanoseconds): unlike wall time, barely moved by other jobs on a shared machine."""
    total = 0
    for pid in pids:
        for stat in glob.glob(f"/proc/{pid}/task/*/schedstat"):
            try:
                with open(stat) as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass  # a thread that ended meanwhile
    return total / 1e9


def _split_collect(executor) -> None:
    """Drop the engine's `then_collect` hint: the executor sends each step alone and each
    collect as its own message."""
    launch = executor.execute_async
    executor.execute_async = lambda sched_out, then_collect=False: launch(sched_out, False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", default="uni:1,mp:1,mp:2",
                    help="backend:tensor-parallel-size, comma-separated; backend mp-2msg: "
                         "mp with a separate collect message per step")
    ap.add_argument("--sizes", default="1,16")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loops", default="sync,async",
                    help="engine loops to time, comma-separated: sync, async (pipelined)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of this process; worker ranks split them")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    loops = args.loops.split(",")
    if not set(loops) <= {"sync", "async"}:
        ap.error(f"--loops takes sync and async, not {args.loops!r}")
    configs = [(b, int(tp)) for b, tp in (c.split(":") for c in args.configs.split(","))]
    llms = {}
    for backend, tp in configs:
        t0 = time.perf_counter()
        llms[backend, tp] = LLM(args.model, device=args.device, max_num_seqs=max(sizes),
                                max_num_batched_tokens=max(256, max(sizes)),
                                max_model_len=args.context + args.steps + 64,
                                tensor_parallel_size=tp,
                                distributed_executor_backend=backend.removesuffix("-2msg"),
                                async_scheduling=False,
                                # Several engines share one GPU here: a fixed KV cache
                                # each (utilization would count the others' as taken).
                                kv_cache_memory="4GiB" if args.device != "cpu" else None)
        print(f"# started {backend} TP={tp} in {time.perf_counter() - t0:.1f} s", flush=True)
        if backend.endswith("-2msg"):
            _split_collect(llms[backend, tp].engine.executor)
        warm_up(llms[backend, tp].engine)
    rows_keys = [(loop, s) for loop in loops for s in sizes]
    step_ms: dict[tuple, list[float]] = {(c, k): [] for c in configs for k in rows_keys}
    # CPU seconds of this process and the config's workers, and engine steps run.
    cpu: dict[tuple, list[float]] = {(c, k): [0.0, 0] for c in configs for k in rows_keys}
    # (Ray's actors are left out: they may run on other nodes.)
    pids = {c: [os.getpid(), *(llms[c].engine.executor.worker_pids()
                               if c[0].startswith("mp") else [])] for c in configs}
    for rep in range(args.repeats):
        for loop, size in rows_keys:
            for config in configs:
                engine = llms[config].engine
                engine.set_async_scheduling(loop == "async")
                cpu_before = _cpu_s(pids[config])
                point = run_sweep_point(engine, size, args.context, args.steps, seed=rep,
                                        warmup_steps=WARMUP_STEPS)
                step_ms[config, (loop, size)] += [t * 1e3 for t in point.step_latencies_s]
                used = cpu[config, (loop, size)]
                used[0] += _cpu_s(pids[config]) - cpu_before
                used[1] += point.prefill_steps + WARMUP_STEPS + args.steps
    model_config = llms[configs[0]].engine.config.model
    hidden, layers = model_config.hidden_size, model_config.num_hidden_layers
    # The CPU (gloo) all-reduce; on CUDA the NCCL one runs inside the TP=2 step.
    reduce_ms = (all_reduce_ms(2, [(s, hidden) for s in sizes]) if args.device == "cpu"
                 else {(s, hidden): float("nan") for s in sizes})
    device = llms[configs[0]].engine.config.device
    # Rank 0's GPU as it reported it (the workers may see GPUs this process does not).
    environment = environment_info(rank_device_facts(llms[configs[0]].engine.runner_info))
    name = environment.get("gpu") or environment["cpu"]
    print(f"\n# executor overhead: {args.model}, {device} ({name}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} torch threads in this process), "
          f"{llms[configs[0]].engine.config.dtype}, torch {torch.__version__}, context {args.context}, {args.steps} timed "
          f"decode steps x {args.repeats} rounds, {datetime.date.today()}")
    head = " | ".join(f"{b} TP={tp} ms/step (CPU)" for b, tp in configs)
    print(f"| loop | batch | {head} | mp TP=1 - uni (IPC) ms | mp-2msg - mp TP=1 ms "
          f"| all-reduce [batch, {hidden}] ms | x {2 * layers} per step ms |")
    print("|---|---:|" + "---:|" * (len(configs) + 4))
    rows = []
    for loop, size in rows_keys:
        medians = {c: statistics.median(step_ms[c, (loop, size)]) for c in configs}
        ipc = (medians[("mp", 1)] - medians[("uni", 1)]
               if ("mp", 1) in medians and ("uni", 1) in medians else float("nan"))
        split = (medians[("mp-2msg", 1)] - medians[("mp", 1)]
                 if ("mp-2msg", 1) in medians and ("mp", 1) in medians else float("nan"))
        reduce = reduce_ms[(size, hidden)]
        cpu_ms = {c: 1e3 * cpu[c, (loop, size)][0] / cpu[c, (loop, size)][1] for c in configs}
        cells = " | ".join(f"{medians[c]:.2f} ({cpu_ms[c]:.2f})" for c in configs)
        print(f"| {loop} | {size} | {cells} | {ipc:+.3f} | {split:+.3f} | {reduce:.3f} "
              f"| {reduce * 2 * layers:.2f} |")
        rows.append({"loop": loop, "batch": size,
                     "step_ms": {f"{b}:{tp}": m for (b, tp), m in medians.items()},
                     "cpu_ms_per_step": {f"{b}:{tp}": m for (b, tp), m in cpu_ms.items()},
                     "ipc_ms": ipc, "split_collect_ms": split, "all_reduce_ms": reduce,
                     "all_reduces_per_step": 2 * layers})
    for llm in llms.values():
        llm.engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": device, "device_name": name,
                       "torch": torch.__version__, "environment": environment,
                       "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
