"""`create_executor`: the backend `--distributed-executor-backend` names. Only the chosen
one is imported (the ray backend imports ray; nothing else does)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmfast.config import EngineConfig
    from llmfast.executor.base import Executor
    from llmfast.models.sources.model_source import ModelSource
    from llmfast.utils.progress import Progress


def create_executor(config: EngineConfig, source: ModelSource,
                    progress: Progress | None = None) -> Executor:
    """The executor, its workers starting (`Executor.initialize` loads the model)."""
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        from llmfast.executor.uni import UniExecutor as cls
    elif backend == "mp":
        from llmfast.executor.mp.multiproc import MultiprocExecutor as cls
    else:  # ParallelConfig admits no other name
        from llmfast.executor.ray.ray_executor import RayExecutor as cls
    return cls(config, source, progress=progress)
