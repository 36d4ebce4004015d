"""What goes wrong between the engine and its workers, as one-line errors naming the rank.

`WorkerDied`: a worker process or Ray actor is gone (killed, crashed, out of memory).
`WorkerFailed`: a worker raised (a model that does not load on a rank, a step that
failed); its traceback stays in the worker's log under --debug, the message is one line.
Either way the executor has shut the other workers down before the error reaches the
engine: an engine whose executor failed runs no further step.
"""

from __future__ import annotations

# A rank's collective fails the moment a peer dies (gloo/NCCL: connection reset by peer),
# and its report may reach the engine before the death does (Ray learns of a dead actor
# through its raylet, later than the surviving rank's gloo does). A rank's failure report
# therefore waits up to this long for another rank's death, which is then reported as
# the cause: "rank 1 died", not "rank 0 failed: connection reset". Error path only.
PEER_DEATH_GRACE_S = 3.0


class ExecutorError(RuntimeError):
    """The executor cannot go on; the message is one user-facing line."""


class WorkerDied(ExecutorError):
    def __init__(self, rank: int, how: str) -> None:
        super().__init__(f"worker rank {rank} died ({how}); the engine stopped")
        self.rank = rank


class WorkerFailed(ExecutorError):
    def __init__(self, rank: int, error: str, during: str) -> None:
        super().__init__(f"worker rank {rank} failed {during}: {error}")
        self.rank = rank
        self.error = error
