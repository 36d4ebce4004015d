"""A multi-turn chat over an `LLM`: history, sampling settings, slash commands and one
streamed reply at a time. No terminal I/O here; `llmfast.cli.chat` drives it.

Each turn re-renders the whole conversation with the chat template, so the prompt of
turn n starts with turn n-1's prompt and reply: the prefix cache serves those blocks and
only the new message is prefilled. An interrupted reply is dropped from the history with
its user message (the turn never happened), so the next prompt still matches the cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from llmfast.sampling_params import SamplingParams, SamplingParamsError


class ChatCommandError(ValueError):
    """A bad slash command; the message is one user-facing line."""


@dataclass(frozen=True)
class ChatSettings:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    seed: int | None = None
    ignore_eos: bool = False
    # From the model's generation_config.json when it has them (no slash command).
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def params(self, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              max_tokens=max_tokens or self.max_tokens, seed=self.seed,
                              ignore_eos=self.ignore_eos)

    @classmethod
    def resolve(cls, model_defaults: dict, **given) -> ChatSettings:
        """The flags given (None: not given), else the model's default (its
        generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty;
        not its max_new_tokens, a generation's length, not a chat turn's), else ours."""
        sampled = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        values = {name: model_defaults[name] for name in sampled if name in model_defaults}
        values.update((name, value) for name, value in given.items() if value is not None)
        return cls(**values)

    def with_setting(self, name: str, raw: str) -> ChatSettings:
        """A copy with one setting parsed from a slash command's argument; validated by
        building SamplingParams, so a bad value never replaces a good one."""
        kinds = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int,
                 "seed": int, "ignore_eos": _parse_bool}
        try:
            value = None if name == "seed" and raw.lower() in ("none", "off") else kinds[name](raw)
        except ValueError:
            raise ChatCommandError(f"cannot read {raw!r} as a value of {name}") from None
        new = dataclasses.replace(self, **{name: value})
        try:
            new.params()
        except SamplingParamsError as e:
            raise ChatCommandError(str(e)) from None
        return new


def _parse_bool(raw: str) -> bool:
    if raw.lower() in ("on", "true", "1", "yes"):
        return True
    if raw.lower() in ("off", "false", "0", "no"):
        return False
    raise ValueError(raw)


# Slash command -> setting it changes.
SETTING_COMMANDS = {"temp": "temperature", "temperature": "temperature", "top_p": "top_p",
                    "top_k": "top_k", "max_tokens": "max_tokens", "seed": "seed",
                    "ignore_eos": "ignore_eos"}

HELP = """commands:
  /reset              forget the conversation (keeps the system prompt)
  /system TEXT        set the system prompt (empty: none) and start over
  /temp X             temperature (0 = greedy); also /top_p X, /top_k N,
                      /max_tokens N, /seed N|none, /ignore_eos on|off
  /settings           show the sampling settings
  /stats              session and engine statistics
  /exit               quit (also Ctrl-D; Ctrl-C stops a reply)"""


@dataclass
class TurnResult:
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    ttft: float | None
    tokens_per_s: float | None  # decode speed after the first token
    finish_reason: str | None
    aborted: bool
    dropped_turns: int  # old turns dropped to fit max-model-len


@dataclass
class SessionTotals:
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    aborted: int = 0


class ChatSession:
    def __init__(self, llm, settings: ChatSettings, system: str | None = None) -> None:
        tokenizer = llm.tokenizer
        if tokenizer is None:
            raise ChatCommandError(f"{llm.engine.no_tokenizer_reason()}, so it cannot chat")
        self.llm = llm
        self.tokenizer = tokenizer
        self.settings = settings
        self.system = system or None
        self.history: list[dict[str, str]] = []
        self.totals = SessionTotals()

    # ---- commands

    def handle_command(self, line: str) -> str | None:
        """Apply a slash command; returns a line to show, or raises ChatCommandError.
        `/exit` is the caller's business (it ends the loop)."""
        name, _, arg = line[1:].strip().partition(" ")
        arg = arg.strip()
        if name == "reset":
            self.history.clear()
            return "conversation reset"
        if name == "system":
            self.system = arg or None
            self.history.clear()
            return "system prompt set; conversation reset" if arg else "system prompt cleared"
        if name in SETTING_COMMANDS:
            if not arg:
                raise ChatCommandError(f"/{name} needs a value")
            setting = SETTING_COMMANDS[name]
            self.settings = self.settings.with_setting(setting, arg)
            return f"{setting} = {getattr(self.settings, setting)}"
        if name == "settings":
            return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.settings).items())
        if name == "help":
            return HELP
        raise ChatCommandError(f"unknown command /{name}; /help lists them")

    # ---- turns

    def _messages(self, history: list[dict[str, str]], user: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + history + [{"role": "user", "content": user}]

    def prompt_ids(self, user: str) -> tuple[list[int], int]:
        """The templated prompt, dropping the oldest turns until it leaves room to answer.
        Returns (token ids, number of turns dropped)."""
        max_len = self.llm.engine.config.scheduler.max_model_len
        history = list(self.history)
        dropped = 0
        while True:
            ids = self.tokenizer.apply_chat_template(self._messages(history, user),
                                                     add_generation_prompt=True,
                                                     plain_fallback=True)
            if len(ids) < max_len or not history:
                break
            history = history[2:]  # one user message and its reply
            dropped += 1
        if len(ids) >= max_len:
            raise ChatCommandError(
                f"the message is {len(ids)} tokens with the template; max-model-len is {max_len}")
        if dropped:
            self.history = history
        return ids, dropped

    def reply(self, user: str, on_delta: Callable[[str], None],
              should_stop: Callable[[], bool] = lambda: False) -> TurnResult:
        """Stream one reply. `should_stop` is polled after every step; when it turns true
        the stream is closed, which aborts the request and frees its blocks."""
        ids, dropped = self.prompt_ids(user)
        max_len = self.llm.engine.config.scheduler.max_model_len
        params = self.settings.params(min(self.settings.max_tokens, max_len - len(ids)))
        stream = self.llm.stream({"prompt_token_ids": ids}, params)
        last = None
        aborted = False
        try:
            for out in stream:
                last = out
                delta = out.outputs[0].delta_text
                if delta:
                    on_delta(delta)
                if out.finished:
                    break
                if should_stop():
                    aborted = True
                    break
        finally:
            stream.close()
        text = last.outputs[0].text if last is not None else ""
        result = _turn_result(last, ids, text, aborted, dropped)
        self.totals.turns += 1
        self.totals.prompt_tokens += len(ids)
        self.totals.cached_tokens += result.num_cached_tokens
        self.totals.output_tokens += result.num_output_tokens
        if aborted:
            self.totals.aborted += 1
        else:
            self.history += [{"role": "user", "content": user},
                             {"role": "assistant", "content": text}]
        return result


def _turn_result(last, ids: list[int], text: str, aborted: bool, dropped: int) -> TurnResult:
    if last is None:
        return TurnResult(text, len(ids), 0, 0, None, None, "abort", True, dropped)
    m = last.metrics
    n = len(last.outputs[0].token_ids)
    speed = None
    if n > 1 and m.token_times:
        span = m.token_times[-1] - m.token_times[0]
        speed = (n - 1) / span if span > 0 else None
    return TurnResult(text, len(ids), last.num_cached_tokens, n, m.ttft, speed,
                      "abort" if aborted else last.outputs[0].finish_reason, aborted, dropped)
