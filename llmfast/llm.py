"""The offline API: `LLM(model=..., **engine_args).generate(prompts, sampling_params)`,
`.chat(messages, sampling_params)` and `.stream(prompt, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence

from llmfast.engine.input_processor import Prompt
from llmfast.engine.llm_engine import LLMEngine
from llmfast.engine.args import EngineArgs
from llmfast.engine.output_router import OutputRouter, RequestStream
from llmfast.outputs import RequestOutput
from llmfast.sampling_params import SamplingParams
from llmfast.utils.progress import CountProgress


class LLM:
    """An engine with a batch API. The keywords are the fields of `EngineArgs` (the CLI's
    engine flags with underscores: dtype, device, seed, max_num_seqs, kv_cache_memory,
    enforce_eager, ...); a string for a size or byte field reads as its flag would
    (`kv_cache_memory="2GiB"`, `cuda_graph_sizes="1..64"`).

    One `LLM` serves any number of callers: `generate` calls and open `stream`s, from one
    thread or several, all batch together in the same engine. Engine steps are serialised
    by a lock (whichever caller needs outputs steps the engine for everyone) and every
    request's outputs go to its own caller. Closing or dropping a stream before it ends
    aborts its request and frees its KV blocks. Do not drive `llm.engine` directly while
    such calls are open."""

    def __init__(self, model: str | None = None, *, progress=None, **engine_args) -> None:
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine.from_engine_args(args, progress=progress)
        self._router = OutputRouter(self.engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate`, `chat` and `stream` use when given no sampling parameters:
        SamplingParams' defaults, overridden by the model's generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) unless
        the engine argument `generation_config="vllm"` says not to."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: CountProgress | bool | None = None,
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
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} sampling params for {len(prompts)} prompts; pass one or one each"
                )
        ids = self._router.add(prompts, params, stream=False)
        callback, close = _progress_callback(progress, len(ids))
        try:
            return self._router.collect(ids, callback)
        except BaseException:
            self._router.release(ids)
            raise
        finally:
            close()

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        progress: CountProgress | bool | None = None,
    ) -> list[RequestOutput]:
        """`generate` for conversations: one (a list of {"role": ..., "content": ...}
        messages) or several (a list of such lists), each rendered by the chat template:
        `chat_template` (a Jinja template) for this call, else the engine's (the model's,
        or the `chat_template` engine argument), with `chat_template_kwargs` as more
        template variables (e.g. Qwen3's `{"enable_thinking": False}`). Outputs in input
        order; each output's `prompt` is the rendered text."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"{self.engine.no_tokenizer_reason()}; chat needs a tokenizer")
        if chat_template is not None:
            tokenizer = tokenizer.with_chat_template(chat_template)
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, "
                             "or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            conversation = [_text_content(m) for m in conversation]
            text, ids = tokenizer.chat_prompt(conversation, add_generation_prompt,
                                              template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, progress=progress)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> RequestStream:
        """An iterator of RequestOutputs for one request, one per step that produced
        any (`outputs[0].delta_text` is the new text). The request is queued now; closing
        the iterator (or dropping it) before it ends aborts the request."""
        (req_id,) = self._router.add([prompt], [sampling_params], stream=True)
        return RequestStream(self._router, req_id)


def _text_content(message):
    """OpenAI's content parts (`[{"type": "text", "text": ...}, ...]`) joined into the
    string a chat template takes, as the server does; anything else as it is (the
    tokenizer checks messages)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return {**message, "content": "".join(p["text"] for p in content)}
    return message


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
