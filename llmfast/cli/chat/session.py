"""A multi-turn chat over an `LLM`: history, sampling settings, slash commands and one
streamed reply at a time. No terminal I/O here; `llmfast.cli.chat.command` drives it.

Each turn re-renders the whole conversation with the chat template, so the prompt of
turn n starts with turn n-1's prompt and reply: the prefix cache serves those blocks and
only the new message is prefilled. An interrupted reply is dropped from the history with
its user message (the turn never happened), so the next prompt still matches the cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from llmfast.cli.chat.repetition import repeating_period
from llmfast.sampling_params import SamplingParams, SamplingParamsError


class ChatCommandError(ValueError):
    """A bad slash command; the message is one user-facing line."""


# Chat's sampling when neither a flag nor the model's generation_config.json sets a value:
# the local-chat defaults of llama.cpp and Ollama (top-k 40, min-p 0.05 as llama.cpp,
# top-p 0.95, a mild repetition penalty), which keep a small model's reply on the likely
# tokens without making it greedy. README "Chat defaults" says why each.
LOCAL_CHAT_DEFAULTS = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                       "repetition_penalty": 1.1}
SAMPLED = tuple(LOCAL_CHAT_DEFAULTS)
DEFAULT_MAX_REPEATS = 4


@dataclass(frozen=True)
class ChatSettings:
    temperature: float = LOCAL_CHAT_DEFAULTS["temperature"]
    top_p: float = LOCAL_CHAT_DEFAULTS["top_p"]
    top_k: int = LOCAL_CHAT_DEFAULTS["top_k"]
    max_tokens: int = 512
    seed: int | None = None
    ignore_eos: bool = False
    min_p: float = LOCAL_CHAT_DEFAULTS["min_p"]
    repetition_penalty: float = LOCAL_CHAT_DEFAULTS["repetition_penalty"]
    # Stop a reply whose tail is one block of tokens this many times over; 0 = never.
    max_repeats: int = DEFAULT_MAX_REPEATS

    def params(self, max_tokens: int | None = None) -> SamplingParams:
        if self.max_repeats < 0 or self.max_repeats == 1:
            raise SamplingParamsError(f"max_repeats must be 0 (off) or at least 2, got "
                                      f"{self.max_repeats}")
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              max_tokens=max_tokens or self.max_tokens, seed=self.seed,
                              ignore_eos=self.ignore_eos)

    @classmethod
    def resolve(cls, model_defaults: dict, preset_defaults: dict | None = None,
                **given) -> tuple[ChatSettings, dict[str, str]]:
        """Each sampling value from the flags given (None: not given), else the model's
        generation_config.json (not its max_new_tokens, a generation's length, not a chat
        turn's), else the preset's (the default model's card), else LOCAL_CHAT_DEFAULTS.
        Returns the settings and where each sampling value came from."""
        values: dict = {}
        origin: dict[str, str] = {}
        layers = ((LOCAL_CHAT_DEFAULTS, "local-chat default"),
                  (preset_defaults or {}, "model card"),
                  (model_defaults, "generation_config.json"),
                  ({k: v for k, v in given.items() if v is not None}, "flag"))
        for layer, name in layers:
            for key, value in layer.items():
                if key in SAMPLED or name == "flag":
                    values[key] = value
                    if key in SAMPLED:
                        origin[key] = name
        return cls(**values), origin

    def describe(self, origin: dict[str, str] | None = None) -> str:
        """`temperature 0.2 (model card), top_k 40, ... · loops stop at 4 repeats`."""
        origin = origin or {}
        parts = []
        for key in SAMPLED:
            value = getattr(self, key)
            source = origin.get(key)
            parts.append(f"{key} {value:g}" + (f" ({source})" if source and source !=
                                                 "local-chat default" else ""))
        loops = f"loops stop at {self.max_repeats} repeats" if self.max_repeats else \
            "no loop stop"
        return ", ".join(parts) + f" · max_tokens {self.max_tokens} · {loops}"

    def with_setting(self, name: str, raw: str) -> ChatSettings:
        """A copy with one setting parsed from a slash command's argument; validated by
        building SamplingParams, so a bad value never replaces a good one."""
        kinds = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int,
                 "seed": int, "ignore_eos": _parse_bool, "min_p": float,
                 "repetition_penalty": float, "max_repeats": int}
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
                    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                    "max_tokens": "max_tokens", "seed": "seed", "ignore_eos": "ignore_eos",
                    "max_repeats": "max_repeats"}

HELP = """commands:
  /reset              forget the conversation (keeps the system prompt)
  /system TEXT        set the system prompt (empty: none) and start over
  /temp X             temperature (0 = greedy); also /top_p X, /top_k N,
                      /min_p X, /repetition_penalty X, /max_tokens N,
                      /max_repeats N (0: no loop stop), /seed N|none,
                      /ignore_eos on|off
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
    repeating_period: int | None = None  # stopped in a loop of this many tokens
    max_model_len: int | None = None  # set when the context's end, not max_tokens, cut it


@dataclass
class SessionTotals:
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    aborted: int = 0
    repeating: int = 0  # replies stopped in a loop


class ChatSession:
    def __init__(self, llm, settings: ChatSettings, system: str | None = None,
                 origin: dict[str, str] | None = None) -> None:
        tokenizer = llm.tokenizer
        if tokenizer is None:
            raise ChatCommandError(f"{llm.engine.no_tokenizer_reason()}, so it cannot chat")
        self.llm = llm
        self.tokenizer = tokenizer
        self.settings = settings
        self.origin = dict(origin or {})  # sampling setting -> where its value came from
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
            self.origin[setting] = "/" + name
            return f"{setting} = {getattr(self.settings, setting)}"
        if name == "settings":
            return self.settings_line()
        if name == "help":
            return HELP
        raise ChatCommandError(f"unknown command /{name}; /help lists them")

    def settings_line(self) -> str:
        seed = "" if self.settings.seed is None else f" · seed {self.settings.seed}"
        return "sampling: " + self.settings.describe(self.origin) + seed

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
        period = None
        repeats = self.settings.max_repeats
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
                # The tail only (a fixed window): the same cost at every step.
                period = repeats and repeating_period(out.outputs[0].token_ids, repeats)
                if period:
                    break
        finally:
            stream.close()
        text = last.outputs[0].text if last is not None else ""
        result = _turn_result(last, ids, text, aborted, dropped, period or None)
        if (result.finish_reason == "length"
                and result.num_output_tokens < self.settings.max_tokens):
            result = dataclasses.replace(result, max_model_len=max_len)
        self.totals.turns += 1
        self.totals.prompt_tokens += len(ids)
        self.totals.cached_tokens += result.num_cached_tokens
        self.totals.output_tokens += result.num_output_tokens
        if aborted:
            self.totals.aborted += 1
            return result
        if period:  # the history keeps one copy of the loop: the next turn starts clean
            self.totals.repeating += 1
            out_ids = last.outputs[0].token_ids
            text = self.tokenizer.decode(out_ids[:len(out_ids) - period * (repeats - 1)])
        self.history += [{"role": "user", "content": user},
                         {"role": "assistant", "content": text}]
        return result


def _turn_result(last, ids: list[int], text: str, aborted: bool, dropped: int,
                 period: int | None = None) -> TurnResult:
    if last is None:
        return TurnResult(text, len(ids), 0, 0, None, None, "abort", True, dropped)
    m = last.metrics
    n = len(last.outputs[0].token_ids)
    speed = None
    if n > 1 and m.token_times:
        span = m.token_times[-1] - m.token_times[0]
        speed = (n - 1) / span if span > 0 else None
    reason = "abort" if aborted else "repeating" if period else last.outputs[0].finish_reason
    return TurnResult(text, len(ids), last.num_cached_tokens, n, m.ttft, speed, reason,
                      aborted, dropped, period)
