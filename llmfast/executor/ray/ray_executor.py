"""`RayExecutor`: one Ray actor per rank (`--distributed-executor-backend ray`), placed by
a placement group with one bundle per rank (a GPU each on CUDA, a CPU each on CPU), on
the cluster at `--ray-address` or on a local one started here.

Each step is pickled once; small steps travel inline with each actor call, a large one
(prompts of new requests) is put in Ray's object store once and every actor reads it
from there. A launch the engine collects right after is one call per actor that also
returns the oldest launched step's tokens (`execute_then_collect`); a separate `collect`
call only when the engine collects without launching. The engine waits for every rank's
`collect` (Ray reports a dead actor's pending call as failed), so a killed actor or a
failing rank ends the wait with an error naming the rank; the remaining actors are
killed. Ray kills an actor when the process that created it (the engine) exits, and a
local cluster started here is shut down with the executor.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import time
import weakref
from typing import TYPE_CHECKING

import torch

from llmfast.config import ConfigError
from llmfast.executor.ray.address import unreachable_reason
from llmfast.executor.base import DistributedExecutor
from llmfast.executor.errors import (
    PEER_DEATH_GRACE_S,
    ExecutorError,
    WorkerDied,
    WorkerFailed,
)
from llmfast.utils.child_processes import child_python_path
from llmfast.executor.ranks import cpu_threads_per_rank, rank_config
from llmfast.worker.worker import WorkerReady, WorkerSpec
from llmfast.utils.errors import one_line

if TYPE_CHECKING:
    from llmfast.config import EngineConfig
    from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from llmfast.models.sources.model_source import ModelSource
    from llmfast.utils.progress import Progress

logger = logging.getLogger(__name__)

EXECUTE_TIMEOUT_S = 600.0
PLACEMENT_TIMEOUT_S = 60.0
# Above this many bytes a step goes through the object store once instead of inline with
# each actor call (Ray's own inline limit is 100 KiB).
INLINE_STEP_BYTES = 64 * 1024
# A local cluster's object store: steps are small; Ray's default takes 30% of the RAM.
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("the ray executor backend needs Ray: pip install 'llmfast[ray]'"
                          ) from None
    return ray


class _RayState:
    """What the finalizer must release: actors, placement group, our Ray connection."""

    def __init__(self) -> None:
        self.actors: list = []
        self.placement_group = None
        self.disconnect = False  # ray.init was ours: ray.shutdown at the end

    def release(self) -> None:
        try:
            ray = import_ray()
            if not ray.is_initialized():
                return
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            if self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.placement_group)
            if self.disconnect:
                ray.shutdown()
        except Exception as e:  # noqa: BLE001 - at exit Ray may be half gone already
            logger.debug("releasing Ray resources: %s", e)
        self.actors = []


class RayExecutor(DistributedExecutor):
    backend = "ray"

    def __init__(self, config: EngineConfig, source: ModelSource,
                 progress: Progress | None = None, execute_timeout_s: float = EXECUTE_TIMEOUT_S) -> None:
        ray = import_ray()
        self._ray = ray
        world = config.parallel.tensor_parallel_size
        self.world_size = world
        self.execute_timeout_s = execute_timeout_s
        self._state = _RayState()
        self._finalizer = weakref.finalize(self, self._state.release)
        self._ready: list[WorkerReady] = []
        # Every rank's result of a call that asked for a step's tokens with its launch,
        # oldest first, until `collect` reads it.
        self._requested: collections.deque[list] = collections.deque()
        cuda = torch.device(config.device).type == "cuda"
        if progress:
            progress("connecting to Ray" if config.parallel.ray_address
                     else "starting a local Ray cluster", None)
        self._connect(config.parallel.ray_address, world)
        try:
            self._place_actors(world, cuda)
        except BaseException:
            self._finalizer()
            raise
        self._config, self._source, self._cuda = config, source, cuda

    def _connect(self, address: str | None, world: int) -> None:
        ray = self._ray
        if ray.is_initialized():
            return  # the caller's own Ray session: used as it is, left connected
        kwargs: dict = {"include_dashboard": False, "log_to_driver": False,
                        "logging_level": logging.WARNING}
        if address is None:
            # The workers must import this llmfast (a checkout, say, not an installed one).
            path = child_python_path(os.environ.get("PYTHONPATH"))
            kwargs.update(num_cpus=max(os.cpu_count() or 1, world),
                          object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                          runtime_env={"env_vars": {"PYTHONPATH": path}})
        reason = address and unreachable_reason(address)
        if reason:
            raise ExecutorError(f"cannot connect to the Ray cluster at {address}: {reason}")
        try:
            ray.init(address=address, **kwargs)
        except Exception as e:  # noqa: BLE001 - Ray's errors for a bad address vary
            where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
            raise ExecutorError(f"cannot connect to {where}: {one_line(e)}") from None
        self._state.disconnect = True

    def _place_actors(self, world: int, cuda: bool) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from llmfast.executor.ray.ray_actor import RayWorkerActor

        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        self._state.placement_group = pg
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ExecutorError(
                f"Ray could not place {world} workers of {bundle} each within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}"
            ) from None
        actor_class = ray.remote(RayWorkerActor)
        for rank in range(world):
            self._state.actors.append(actor_class.options(
                num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank),
            ).remote())

    # ------------------------------------------------------------------ start-up

    def initialize(self, eos_token_ids: tuple[int, ...] = (),
                   progress: Progress | None = None) -> int:
        if progress:
            progress(f"loading the model on {self.world_size} Ray worker(s)", None)
        config, world = self._config, self.world_size
        host, port = self._gather([self._state.actors[0].rendezvous_address.remote()],
                                  None, "during start-up")[0]
        threads = cpu_threads_per_rank(config.device, world)
        device = "cuda:0" if self._cuda else config.device  # Ray shows each actor its GPU
        config_of_rank = rank_config(config, device, world)
        refs = [actor.start.remote(WorkerSpec(
                    rank=rank, world_size=world, config=config_of_rank, source=self._source,
                    eos_token_ids=tuple(eos_token_ids), init_method=f"tcp://{host}:{port}",
                    cpu_threads=threads))
                for rank, actor in enumerate(self._state.actors)]
        self._ready = self._gather(refs, None, "during start-up")
        return min(r.num_blocks for r in self._ready)

    def worker_pids(self) -> list[int]:
        """The actors' process ids (on their nodes)."""
        return self._gather([a.pid.remote() for a in self._state.actors], None, "")

    # ------------------------------------------------------------------ steps

    def execute_async(self, sched_out: SchedulerOutput, then_collect: bool = False
                      ) -> int | None:
        self._check_usable()
        data = pickle.dumps(sched_out, protocol=pickle.HIGHEST_PROTOCOL)  # once
        arg = self._ray.put(data) if len(data) > INLINE_STEP_BYTES else data
        launched = bool(sched_out.total_num_scheduled_tokens)
        if self._book_launch(launched, then_collect):
            self._requested.append([actor.execute_then_collect.remote(arg)
                                    for actor in self._state.actors])
        else:
            for actor in self._state.actors:
                actor.execute.remote(arg)
        return sched_out.step_index if launched else None

    def collect(self, handle: int) -> ModelRunnerOutput:
        self._check_usable()
        if self._requested:
            refs = self._requested.popleft()  # asked for with a launch
        else:
            self._book_request()
            refs = [actor.collect.remote() for actor in self._state.actors]
        return self._gather(refs, time.monotonic() + self.execute_timeout_s, "in a step")[0]

    def check_health(self) -> None:
        self._check_usable()
        self._gather([a.pid.remote() for a in self._state.actors],
                     time.monotonic() + self.execute_timeout_s, "")

    # ------------------------------------------------------------------ plumbing

    def _gather(self, refs: list, deadline: float | None, during: str) -> list:
        """Every rank's result, in rank order; the first failure (a dead actor, an error)
        raises as soon as it is known, naming its rank."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=self._time_left(deadline))
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise self._fail(WorkerDied(rank, _actor_death(e))) from None
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None) or e
                    raise self._fail(WorkerFailed(rank, one_line(cause, max_chars=None),
                                                  during or "in a step")) from None
        return results

    def _peer_death_behind(self, failure: WorkerFailed,
                           grace_s: float = PEER_DEATH_GRACE_S) -> ExecutorError:
        # Asks every other actor for its pid: a live one answers after the call it is
        # busy with (likely blocked on the failed rank: no answer), a dead one's answer
        # is a RayActorError once Ray has learned of the death.
        ray = self._ray
        rank_of = {actor.pid.remote(): rank for rank, actor in enumerate(self._state.actors)
                   if rank != failure.rank}
        others = list(rank_of)
        deadline = time.monotonic() + grace_s
        while others:
            ready, others = ray.wait(others, num_returns=1,
                                     timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                return WorkerDied(rank_of[ready[0]], _actor_death(e))
            except ray.exceptions.RayTaskError:
                pass  # failed too, most likely for the same cause
        return failure



def _actor_death(error: BaseException) -> str:
    text = one_line(error, max_chars=None)
    return "Ray actor died" if "died" in text.lower() or not text else f"Ray actor: {text}"
