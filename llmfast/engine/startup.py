"""An engine's start: the executor (the model on its devices, the KV cache sized) and the
tokenizer, loaded beside each other. The engine core needs the tokenizer's end-of-sequence
ids; the frontends need the tokenizer itself (the in-process engine shares this one, a
frontend process loads its own with `load_frontend_tokenizer`)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from llmfast.config import EngineConfig
from llmfast.engine.processing.tokenizer import FrontendTokenizer, load_frontend_tokenizer
from llmfast.executor import Executor, create_executor
from llmfast.models.sources.model_source import ModelSource
from llmfast.utils.progress import Progress

logger = logging.getLogger(__name__)


@dataclass
class Started:
    executor: Executor
    num_blocks: int
    tokens: FrontendTokenizer
    startup_times: dict[str, float] = field(default_factory=dict)  # the engine's own stages


def start_engine(config: EngineConfig, source: ModelSource,
                 progress: Progress | None = None) -> Started:
    """The executor started and the tokenizer loaded. Workers boot while the tokenizer
    loads; they are stopped if the rest of start-up fails."""
    executor = create_executor(config, source, progress=progress)
    times: dict[str, float] = {}
    try:
        if executor.late_eos_token_ids and config.chat_template is None:
            num_blocks, tokens = _initialize_beside_tokenizer(config, source, executor,
                                                              progress, times)
        else:
            t0 = time.perf_counter()
            tokens = load_frontend_tokenizer(config, source)
            times["tokenizer"] = time.perf_counter() - t0
            num_blocks = executor.initialize(tokens.eos_token_ids, progress)
    except BaseException:
        executor.shutdown()
        raise
    return Started(executor, num_blocks, tokens, times)


def _initialize_beside_tokenizer(config: EngineConfig, source: ModelSource,
                                 executor: Executor, progress: Progress | None,
                                 times: dict[str, float]) -> tuple[int, FrontendTokenizer]:
    """The runner's start-up in this thread, the tokenizer's load in another. On a warm
    start the tokenizer (importing transformers: 1.6 s on an H100 machine) was a sixth
    of the time to the first token, while the runner's stages leave the interpreter
    free for much of theirs (waits on the device, graph instantiation, file reads).
    Only the wait for it after the runner's start counts as a stage
    (`tokenizer_wait`). A --chat-template loads first instead: a bad one should fail
    before the start-up's seconds, not after them."""
    loading: Future = Future()

    def load() -> None:
        t0 = time.perf_counter()
        try:
            tokens = load_frontend_tokenizer(config, source)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            loading.set_exception(e)
        else:
            loading.set_result((tokens, time.perf_counter() - t0))

    # A daemon: a start that fails meanwhile (or is interrupted) exits at once, not
    # after the tokenizer's load.
    threading.Thread(target=load, name="llmfast-tokenizer", daemon=True).start()
    num_blocks = executor.initialize((), progress)
    t0 = time.perf_counter()
    tokens, load_s = loading.result()
    times["tokenizer_wait"] = time.perf_counter() - t0
    executor.set_eos_token_ids(tokens.eos_token_ids)
    logger.debug("tokenizer loaded in %.2f s beside the runner's start-up", load_s)
    return num_blocks, tokens
