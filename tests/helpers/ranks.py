"""Run a function on every rank of a CPU tensor-parallel group (gloo), one spawned
process per rank, and collect what each returns.

    results = run_ranks(fn, 2, *args)  # fn(group, *args) on ranks 0 and 1

`fn` must be importable (defined at a module's top level) and its arguments and result
picklable. The ranks fork from a forkserver that has imported torch, Dynamo and
llmfast's model and runner once per test session: a spawned rank would pay ~6 s of
imports each time. A rank that raises or dies fails the call with its traceback; the processes
are joined (or killed at the timeout), never left behind.
"""

from __future__ import annotations

import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from llmfast.utils.ports import free_port


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int,
               args: tuple, results: Any, device_type: str) -> None:
    import torch

    from llmfast.distributed import init_tensor_parallel

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cpu":
        torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        group = init_tensor_parallel(rank, world_size, f"tcp://127.0.0.1:{port}", device,
                                     timeout_s=120)
        results.put((rank, "ok", fn(group, *args)))
    except BaseException:  # noqa: BLE001 - any failure goes back to the parent as text
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


PRELOAD = ["torch", "torch._dynamo", "llmfast.models.loading.loader", "llmfast.worker.model_runner",
           "tests.helpers.tp_runs"]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = 300.0, device_type: str = "cpu") -> list[Any]:
    """[fn(group_of_rank_0, *args), fn(group_of_rank_1, *args), ...]. `device_type`
    "cuda": rank r on cuda:r, NCCL; "cpu": gloo."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results,
                                                      device_type))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and not p.is_alive()]
                if dead and results.empty():
                    raise AssertionError(f"rank {dead[0]} exited with code "
                                         f"{procs[dead[0]].exitcode} and no result") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(out))} "
                                         f"gave no result within {timeout_s:.0f} s") from None
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
