"""The offline API: `LLM(model=..., **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from llmfast.engine import LLMEngine, Prompt
from llmfast.engine_args import EngineArgs
from llmfast.outputs import RequestOutput
from llmfast.sampling_params import SamplingParams

# Called as (finished requests, total requests) after each engine step.
GenerateProgress = Callable[[int, int], None]


class LLM:
    """An engine with a batch API. Engine args are the CLI's engine flags with underscores:
    dtype, device, seed, max_num_seqs, max_num_batched_tokens, max_model_len, block_size,
    kv_cache_memory, gpu_memory_utilization, enforce_eager, compile, cuda_graphs, ..."""

    def __init__(self, model: str | None = None, *, progress=None, **engine_args) -> None:
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine.from_engine_args(args, progress=progress)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: GenerateProgress | bool | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion, batched; outputs come back in input order.

        `progress=True` shows a progress bar on stderr; a callable receives
        (finished, total) after every step instead."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} sampling params for {len(prompts)} prompts; pass one or one each"
                )
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p, stream=False))
        except Exception:
            for req_id in ids:
                self.engine.abort(req_id)
            raise
        callback, close = _progress_callback(progress, len(ids))
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                if callback:
                    callback(len(final), len(ids))
        except BaseException:
            for req_id in ids:
                if req_id not in final:
                    self.engine.abort(req_id)
            raise
        finally:
            close()
        return [final[i] for i in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield a RequestOutput per step for one request (`outputs[0].delta_text` is the
        new text); closing the iterator early aborts the request."""
        req_id = self.engine.add_request(prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == req_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(req_id)


def _progress_callback(progress, total: int):
    if progress is True:
        if total < 2:
            return None, lambda: None
        from rich.console import Console
        from rich.progress import Progress

        bar = Progress(console=Console(stderr=True), transient=True)
        task = bar.add_task("generating", total=total)
        bar.start()
        return (lambda done, _: bar.update(task, completed=done)), bar.stop
    return (progress or None), (lambda: None)
