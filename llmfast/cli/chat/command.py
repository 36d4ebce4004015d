"""`llmfast chat`: interactive multi-turn chat, or a scripted one through a pipe.

In a terminal: Rich prompt, tokens stream as they come, a dim line after each reply
(TTFT, tokens/s, prefix-cache hits). Ctrl-C during a reply stops that reply (the request
is aborted, the turn dropped from the history); Ctrl-C or Ctrl-D at the prompt exits.

Piped (stdin not a terminal): one message or /command per line; each reply is written
plainly to stdout followed by an empty line; stats and command acknowledgements go to
stderr. A line that is not UTF-8 (one `error:` line says which line and byte), or a turn
or command that fails, is reported and the run goes on, but exits 1 at the end, so that
a script sees that not every line was answered. End of input (Ctrl-D) ends the chat.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.console import Console

from llmfast.cli.chat.session import (
    DEFAULT_MAX_REPEATS,
    ChatCommandError,
    ChatSession,
    ChatSettings,
    TurnResult,
)
from llmfast.cli.common import (
    EngineOptions,
    IgnoreEos,
    MaxTokens,
    System,
    engine_stats,
    load_llm,
    print_error,
    stderr_console,
)
from llmfast.cli.chat.repetition import MAX_PERIOD

# "The model's": its generation_config.json, or the default model's card (CHAT_EXAMPLES).
_MODEL_DEFAULT = "  [default: the model's, else {}]"
ChatTemperature = Annotated[float | None, typer.Option(
    "--temperature", "-t", show_default=False,
    help="Sampling temperature; 0 is greedy." + _MODEL_DEFAULT.format(0.7))]
ChatTopP = Annotated[float | None, typer.Option(
    "--top-p", help="Nucleus sampling mass, in (0, 1]." + _MODEL_DEFAULT.format(0.95),
    show_default=False)]
ChatTopK = Annotated[int | None, typer.Option(
    "--top-k", help="Keep the k likeliest tokens; 0 or -1 = off." + _MODEL_DEFAULT.format(40),
    show_default=False)]
ChatMinP = Annotated[float | None, typer.Option(
    "--min-p", help="Drop tokens below this fraction of the likeliest one's probability; 0 = "
    "off." + _MODEL_DEFAULT.format(0.05), show_default=False)]
ChatRepetitionPenalty = Annotated[float | None, typer.Option(
    "--repetition-penalty", help="Divide the logits of tokens already in the conversation "
    "by this (HF/vLLM); 1 = off." + _MODEL_DEFAULT.format(1.1), show_default=False)]
MaxRepeats = Annotated[int, typer.Option(
    "--max-repeats", help="Stop a reply whose last tokens are one block of up to "
    f"{MAX_PERIOD} tokens repeated this many times (a loop), with a 'stopped: repeating' "
    "notice; 0 = never.")]

CHAT_EXAMPLES = """\
**Examples**

* `llmfast chat`  (the default model, SmolLM2-135M-Instruct)

* `llmfast chat --model ./Llama-3.2-1B-Instruct --temperature 0 --system "Be brief."`

* `printf 'Hi!\\n/temp 0\\nName a colour.\\n' | llmfast chat`  (scripted: one message per line)

In the chat: /reset, /system TEXT, /temp X, /top_p X, /top_k N, /min_p X,
/repetition_penalty X, /max_tokens N, /max_repeats N, /seed N, /ignore_eos on|off,
/settings, /stats, /help, /exit. Ctrl-C stops a reply; Ctrl-C or Ctrl-D at the prompt
quits. A sampling default marked "the model's" comes from its generation_config.json (or,
for the default model, its model card); the settings in use, and where each came from,
are shown at the start.
"""

EXIT_COMMANDS = ("/exit", "/quit")


def _is_exit(line: str) -> bool:
    """/exit or /quit, with anything after it ("/exit now")."""
    words = line.split()
    return bool(words) and words[0] in EXIT_COMMANDS


def chat(
    *,
    opts: EngineOptions,
    system: System = None,
    temperature: ChatTemperature = None,
    top_p: ChatTopP = None,
    top_k: ChatTopK = None,
    min_p: ChatMinP = None,
    repetition_penalty: ChatRepetitionPenalty = None,
    max_tokens: MaxTokens = 512,
    max_repeats: MaxRepeats = DEFAULT_MAX_REPEATS,
    ignore_eos: IgnoreEos = False,
) -> None:
    """Chat with a model, multi-turn, with its chat template."""
    from llmfast.models.sources.default_model import DEFAULT_MODEL_CARD_SAMPLING

    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                 repetition_penalty=repetition_penalty, max_tokens=max_tokens,
                 max_repeats=max_repeats, ignore_eos=ignore_eos,
                 seed=opts.engine_kwargs.get("seed"))
    ChatSettings.resolve({}, **given)[0].params()  # validate before the model loads
    err = stderr_console()
    llm = load_llm(opts, err)
    card = DEFAULT_MODEL_CARD_SAMPLING if opts.model is None else None
    settings, origin = ChatSettings.resolve(dict(llm.engine.config.sampling_defaults), card,
                                            **given)
    session = ChatSession(llm, settings, system, origin)
    if sys.stdin.isatty():
        _interactive(session, Console(highlight=False))
    else:
        err.print(session.settings_line(), markup=False, soft_wrap=True, style="dim")
        _piped(session, err)


# ---------------------------------------------------------------------- piped


def _piped(session: ChatSession, err: Console) -> None:
    failed = _piped_lines(session, err)
    if failed:
        raise typer.Exit(1)


def _piped_lines(session: ChatSession, err: Console) -> int:
    """Answer each input line; returns how many failed (each reported already)."""
    out = sys.stdout
    failed = 0
    for number, raw in enumerate(sys.stdin.buffer, start=1):
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            print_error(f"line {number} of the input is not valid UTF-8 (byte {e.start + 1}); "
                        "skipped")
            failed += 1
            continue
        if not line.strip():
            continue
        if _is_exit(line):
            break
        if line.startswith("/"):
            failed += not _command(session, line, err)
            continue
        result = _reply(session, line, lambda delta: (out.write(delta), out.flush()))
        if result is None:
            failed += 1
            continue
        out.write("\n\n")
        out.flush()
        err.print(_stats_line(result), markup=False, soft_wrap=True)
    return failed


# ---------------------------------------------------------------------- interactive


def _interactive(session: ChatSession, con: Console) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (loaded, it gives input() line editing and history)
    con.print("[dim]llmfast chat: /help for commands, Ctrl-D to quit[/]")
    con.print(session.settings_line(), markup=False, style="dim", soft_wrap=True)
    while True:
        try:
            line = con.input("[bold green]you ›[/] ")
            line.encode("utf-8")  # surrogate escapes mean the bytes were not UTF-8
        except (EOFError, KeyboardInterrupt):
            con.print()
            return
        except (UnicodeDecodeError, UnicodeEncodeError):
            print_error("the input is not valid UTF-8; message ignored")
            continue
        if not line.strip():
            continue
        if _is_exit(line):
            return
        if line.startswith("/"):
            _command(session, line, con)
            continue
        # Before the prompt: a ^C from then on stops the reply, a key typed is held.
        with _stop_on_sigint() as stop, _keys_held(sys.stdin):
            con.print("[bold blue]llm ›[/] ", end="")
            result = _reply(session, line, lambda delta: _write(con, delta), stop)
        con.print()
        if result is None:
            continue
        if result.aborted:
            con.print("[yellow]reply stopped; it is dropped from the conversation[/]")
        if result.repeating_period:
            con.print(f"[yellow]{_repeating_notice(result, session)}[/]")
        con.print(f"[dim]{_stats_line(result)}[/]", highlight=False)


def _reply(session: ChatSession, line: str, on_delta, stop=lambda: False) -> TurnResult | None:
    """One turn; a message that cannot be sent (too long for max-model-len, a template
    error) is reported and the chat goes on."""
    from llmfast.config import ConfigError  # (TokenizerError is one)
    from llmfast.core.request import RequestRejected

    try:
        return session.reply(line, on_delta, stop)
    except (ChatCommandError, RequestRejected, ConfigError) as e:
        print_error(str(e))
        return None


def _write(con: Console, delta: str) -> None:
    con.file.write(delta)  # raw text: model output is not Rich markup
    con.file.flush()


@contextlib.contextmanager
def _stop_on_sigint() -> Iterator:
    """While a reply streams, Ctrl-C sets a flag that the stream polls between engine
    steps, instead of raising in the middle of a step (which would leave the scheduler
    and the runner out of step)."""
    pressed = []

    def handler(signum, frame) -> None:
        pressed.append(True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _keys_held(stdin) -> Iterator[None]:
    """While a reply streams, keys typed are neither echoed into it nor lost: the terminal
    stops echoing (ECHO off) and keeps them queued, through a ^C too (NOFLSH), so the
    next prompt starts with them. The settings come back whatever happens."""
    try:
        import termios

        fd = stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (ImportError, AttributeError, ValueError, OSError):  # not a terminal
        yield
        return
    held = list(saved)
    held[3] = (held[3] & ~termios.ECHO) | termios.NOFLSH  # lflags
    termios.tcsetattr(fd, termios.TCSANOW, held)  # NOW, not FLUSH: keep what is queued
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


# ---------------------------------------------------------------------- shared


def _command(session: ChatSession, line: str, con: Console) -> bool:
    """Apply a /command; False if it failed (reported)."""
    if line.strip() == "/stats":
        con.print(_stats_report(session), markup=False, soft_wrap=True)
        return True
    try:
        message = session.handle_command(line)
    except ChatCommandError as e:
        print_error(str(e))
        return False
    if message:
        con.print(message, markup=False, style="dim")
    return True


def _stats_line(r: TurnResult) -> str:
    parts = []
    if r.ttft is not None:
        parts.append(f"TTFT {r.ttft * 1000:.0f} ms")
    if r.tokens_per_s is not None:
        parts.append(f"{r.tokens_per_s:.1f} tok/s")
    parts.append(f"{r.num_output_tokens} tokens")
    parts.append(f"prefix cache {r.num_cached_tokens}/{r.num_prompt_tokens} prompt tokens")
    if r.dropped_turns:
        parts.append(f"{r.dropped_turns} old turn(s) dropped to fit")
    if r.finish_reason == "length":
        parts.append("stopped at max tokens" if r.max_model_len is None else
                     f"stopped at the context's end (max-model-len {r.max_model_len})")
    if r.repeating_period:
        parts.append("stopped: repeating")
    return " · ".join(parts)


def _repeating_notice(r: TurnResult, session: ChatSession) -> str:
    return (f"stopped: repeating (the last {r.repeating_period} token(s) "
            f"{session.settings.max_repeats} times in a row); the conversation keeps one "
            "copy. /max_repeats 0 turns this off")


def _stats_report(session: ChatSession) -> str:
    t = session.totals
    hit = t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0
    lines = [
        f"turns {t.turns} ({t.aborted} stopped, {t.repeating} stopped repeating), prompt "
        f"tokens {t.prompt_tokens}, from prefix cache {t.cached_tokens} ({hit:.0%}), "
        f"generated {t.output_tokens}",
        session.settings_line(),
    ]
    stats = engine_stats(session.llm.engine)
    spec = {k: stats.pop(k) for k in list(stats) if k.startswith("spec_")}
    if stats:
        lines.append("engine: " + ", ".join(f"{k}={_fmt(v)}" for k, v in stats.items()))
    if session.llm.engine.config.speculative is not None and spec:
        lines.append(
            f"speculative decoding ({session.llm.engine.config.speculative.method}): "
            f"acceptance {spec['spec_acceptance_rate']:.1%}, mean accepted length "
            f"{spec['spec_mean_accepted_length']:.2f} tokens per verify step "
            f"({spec['spec_num_accepted_tokens']} of {spec['spec_num_draft_tokens']} drafts "
            f"in {spec['spec_num_verify_steps']} steps)")
    startup = session.llm.engine.startup_times
    if startup:
        lines.append("start-up: " + ", ".join(f"{k} {v:.2f} s" for k, v in startup.items()))
    return "\n".join(lines)


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
