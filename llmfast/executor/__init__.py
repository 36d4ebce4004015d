"""Executors: how the engine runs the model on one device or many (see base.py)."""

from llmfast.executor.base import Executor
from llmfast.executor.errors import ExecutorError, WorkerDied, WorkerFailed
from llmfast.executor.factory import create_executor

__all__ = ["Executor", "ExecutorError", "WorkerDied", "WorkerFailed", "create_executor"]
