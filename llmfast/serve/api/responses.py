"""OpenAI response JSON from engine deltas: whole responses, streaming chunks, usage and
both logprobs formats (completions: tokens / token_logprobs / top_logprobs / text_offset;
chat: content[{token, logprob, bytes, top_logprobs}]), and vLLM's `prompt_logprobs`
([null, {id: {logprob, rank, decoded_token}}, ...]).

Completions with echo and logprobs list the prompt's tokens first (the first with null
logprobs), then the generated ones, as vLLM does; streamed, the prompt comes in each
choice's first chunk, with its first generated text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from llmfast.serve.api.tools import ToolMode, ToolStream, message_tool_calls
from llmfast.serve.frontend_types import ChoiceDelta, PreparedPrompt, TokenLogprob

Kind = Literal["completion", "chat"]


@dataclass
class _Choice:
    prompt: PreparedPrompt
    text: list[str] = field(default_factory=list)
    text_len: int = 0  # chars of text so far (completions' text_offset)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    echoed: bool = False  # streaming: the prompt went out already
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tool_stream: ToolStream | None = None  # streamed chat with tools


class ResponseBuilder:
    """One HTTP request's response: feed it deltas, ask for chunks or the whole body."""

    def __init__(self, kind: Kind, request_id: str, model: str,
                 prompts: list[PreparedPrompt], n: int, echo: bool = False,
                 want_logprobs: bool = False, want_prompt_logprobs: bool = False,
                 scoring_only: bool = False, tools: ToolMode | None = None) -> None:
        """`want_prompt_logprobs`: vLLM's `prompt_logprobs` field; `scoring_only`: echo
        with max_tokens 0, whose one generated token is left out."""
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.prompts = prompts
        self.n = n
        self.echo = echo
        self.want_logprobs = want_logprobs
        self.want_prompt_logprobs = want_prompt_logprobs
        self.scoring_only = scoring_only
        self.choices = [_Choice(prompts[i // n]) for i in range(len(prompts) * n)]
        self.tools = tools  # chat with tools: the output becomes tool calls
        if tools is not None:
            for choice in self.choices:
                choice.tool_stream = tools.stream()
        self.num_finished = 0

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.choices)

    def add(self, delta: ChoiceDelta) -> _Choice:
        choice = self.choices[delta.index]
        choice.num_output_tokens = 0 if self.scoring_only else delta.num_output_tokens
        choice.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        if delta.logprobs and not self.scoring_only:
            choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None and choice.finish_reason is None:
            choice.finish_reason = _finish_reason(delta.finish_reason)
            choice.stop_reason = delta.stop_reason
            self.num_finished += 1
        return choice

    # ---------------------------------------------------------------- usage

    def usage(self) -> dict:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(c.num_output_tokens for c in self.choices)
        cached = sum(self.choices[i * self.n].num_cached_tokens for i in range(len(self.prompts)))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---------------------------------------------------------------- whole response

    def add_text(self, delta: ChoiceDelta) -> None:
        """Non-streaming: keep the delta's text too."""
        choice = self.add(delta)
        if delta.text and not self.scoring_only:
            choice.text.append(delta.text)

    def response(self) -> dict:
        if self.kind == "completion":
            choices = [self._completion_choice(i, c) for i, c in enumerate(self.choices)]
            obj = "text_completion"
        else:
            choices = [self._chat_choice(i, c) for i, c in enumerate(self.choices)]
            obj = "chat.completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}
        if self.kind == "chat" and self.want_prompt_logprobs:  # vLLM's place for chat's
            body["prompt_logprobs"] = _vllm_prompt_logprobs(self.choices[0].prompt_logprobs)
        return body

    def _completion_choice(self, index: int, c: _Choice) -> dict:
        head = (c.prompt.text or "") if self.echo else ""
        body = {"index": index, "text": head + "".join(c.text),
                "logprobs": self._completion_logprobs(c, c.logprobs, len(head))
                if self.want_logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.want_prompt_logprobs:
            body["prompt_logprobs"] = _vllm_prompt_logprobs(c.prompt_logprobs)
        return body

    def _completion_logprobs(self, c: _Choice, generated: list[TokenLogprob], offset: int
                             ) -> dict:
        """The generated tokens' logprobs (their text offsets from `offset`), after the
        prompt's (offsets from 0) where the prompt is echoed and not sent yet."""
        out = _completion_logprobs(generated, offset)
        if self.echo and not c.echoed and c.prompt_logprobs is not None:
            head = _completion_logprobs(list(c.prompt_logprobs), 0)
            out = {key: head[key] + out[key] for key in out}
        return out

    def _chat_choice(self, index: int, c: _Choice) -> dict:
        message = {"role": "assistant", "content": "".join(c.text)}
        finish = c.finish_reason
        if self.tools is not None:
            content, calls = self.tools.parse(message["content"])
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": message_tool_calls(calls)}
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message,
                "logprobs": _chat_logprobs(c.logprobs) if self.want_logprobs else None,
                "finish_reason": finish, "stop_reason": c.stop_reason}

    # ---------------------------------------------------------------- streaming chunks

    def first_chunks(self) -> list[dict]:
        """Chat: the assistant role, once per choice (a completion's echo goes with its
        first tokens, `chunk`)."""
        if self.kind == "chat":
            return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                    for i in range(len(self.choices))]
        return []

    def chunk(self, delta: ChoiceDelta) -> dict | None:
        """The streaming chunk of one delta (call instead of `add`); None when it has
        nothing to tell (a chat with tools holding back text that may be a call)."""
        choice = self.add(delta)
        finish = choice.finish_reason if delta.finish_reason is not None else None
        logprobs = None
        if self.kind == "completion":
            text = "" if self.scoring_only else delta.text
            head = ""
            if self.echo and not choice.echoed:  # vLLM's way: with the first tokens
                head = choice.prompt.text or ""
                choice.text_len = len(head)
            if self.want_logprobs:
                generated = [] if self.scoring_only else list(delta.logprobs or ())
                logprobs = self._completion_logprobs(choice, generated, choice.text_len)
            choice.echoed = True
            choice.text_len += len(text)
            body = {"index": delta.index, "text": head + text, "logprobs": logprobs,
                    "finish_reason": finish}
        else:
            if self.want_logprobs:
                logprobs = _chat_logprobs(list(delta.logprobs or ()))
            if choice.tool_stream is not None:
                body = self._tool_chunk(choice.tool_stream, delta, finish)
                if not body["delta"] and finish is None and not (logprobs or {}).get("content"):
                    return None  # a token held back: no empty `delta: {}` per token
                body["logprobs"] = logprobs
            else:
                body = {"index": delta.index,
                        "delta": {"content": delta.text} if delta.text or finish is None
                        else {},
                        "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            body["stop_reason"] = choice.stop_reason
        return self._chunk([body])

    @staticmethod
    def _tool_chunk(stream: ToolStream, delta: ChoiceDelta, finish: str | None) -> dict:
        content, calls = stream.feed(delta.text or "")
        if finish is not None:
            more, end_calls = stream.finish()
            content, calls = content + more, calls + end_calls
            if stream.num_calls and finish == "stop":
                finish = "tool_calls"
        body: dict = {}
        if content:
            body["content"] = content
        if calls:
            body["tool_calls"] = calls
        return {"index": delta.index, "delta": body, "finish_reason": finish}

    def usage_chunk(self) -> dict:
        return {**self._chunk([]), "usage": self.usage()}

    def _chunk(self, choices: list[dict]) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": None}


def _finish_reason(reason: str) -> str:
    # "abort" only reaches a client when the engine ended the request itself.
    return reason if reason in ("stop", "length") else "abort"


def _completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        offsets.append(offset)
        offset += len(e.token)
        if e.logprob is None:  # a prompt's first token: nothing scored it
            top.append(None)
            continue
        # Keyed by text, as OpenAI's format is: distinct ids can decode alike (e.g. bytes
        # of one character), and then the likelier keeps the key.
        alternatives: dict[str, float] = {}
        for tok, _, lp in e.top:
            alternatives.setdefault(tok, lp)
        # OpenAI's completions always list the sampled token too (up to logprobs + 1
        # entries), so `logprobs: 0` still shows it.
        alternatives.setdefault(e.token, e.logprob)
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def _vllm_prompt_logprobs(entries: tuple[TokenLogprob, ...] | None) -> list | None:
    """vLLM's format: null for the first token, then per token {id: {logprob, rank,
    decoded_token}} for the prompt token and its top n (ranked 1..n)."""
    if entries is None:
        return None
    out: list = [None]
    for e in entries[1:]:
        position = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": tok}
                    for rank, (tok, tid, lp) in enumerate(e.top, 1)}
        position[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank,
                                     "decoded_token": e.token}
        out.append(position)
    return out


def _chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
         "top_logprobs": [{"token": tok, "logprob": lp, "bytes": list(tok.encode())}
                          for tok, _, lp in e.top]}
        for e in entries]}
