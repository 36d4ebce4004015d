"""`llmfast generate`: one-shot prompts, batched through `LLM.generate`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from llmfast.cli.common import (
    EngineOptions,
    IgnoreEos,
    MaxTokens,
    System,
    Temperature,
    TopK,
    TopP,
    JsonPath,
    check_json_path,
    count_progress,
    load_llm,
    stderr_console,
)
from llmfast.cli.structured_flags import structured_flags
from llmfast.outputs import GenerationInterrupted
from llmfast.sampling_params import SamplingParams

GENERATE_EXAMPLES = """\
**Examples**

* `llmfast generate "What is the capital of France?"`

* `llmfast generate "Tell me a joke" "Write a haiku" --temperature 0.8 --max-tokens 64`

* `llmfast generate --file prompts.txt --json out.json`  (one prompt per line; `--json -`: to stdout)

* `llmfast generate --no-chat --stop "." "The capital of France is"`

* `llmfast generate --json-schema person.json "Describe a person as JSON"`  (also `--regex`, `--choice yes,no`, `--grammar FILE`)
"""


def generate(
    *,
    opts: EngineOptions,
    prompts: Annotated[list[str] | None, typer.Argument(help="Prompts (or use --file).",
                                                         show_default=False)] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", help="Read prompts from a file, one per line.")] = None,
    max_tokens: MaxTokens = 128,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", help="Stop string (repeatable).")] = None,
    chat: Annotated[bool | None, typer.Option(
        "--chat/--no-chat", help="Apply the chat template.  [default: on if the model has one]",
        show_default=False)] = None,
    system: System = None,
    ignore_eos: IgnoreEos = False,
    json_out: JsonPath = None,
    json_schema: Annotated[Path | None, typer.Option(
        "--json-schema", help="Constrain the output to JSON valid against this JSON Schema "
        "file.", show_default=False)] = None,
    regex: Annotated[str | None, typer.Option(
        "--regex", help="Constrain the output to match this regular expression.",
        show_default=False)] = None,
    choice: Annotated[str | None, typer.Option(
        "--choice", help="Constrain the output to one of these comma-separated strings.",
        show_default=False)] = None,
    grammar: Annotated[Path | None, typer.Option(
        "--grammar", help="Constrain the output to this grammar file (EBNF with "
        "'root ::= ...', or Lark).", show_default=False)] = None,
) -> None:
    """Generate completions for one or more prompts, batched."""
    if sys.stdout is None:  # started with standard output closed (`>&-`)
        raise ValueError("standard output is closed: the completions would be lost; "
                         "redirect it instead (e.g. > out.txt)")
    check_json_path(json_out)
    texts = _read_prompts(prompts or [], file)
    if system is not None and chat is False:
        raise ValueError("--system needs the chat template; drop --no-chat")
    structured = structured_flags(json_schema, regex, choice, grammar)
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
        stop=tuple(stop or ()), seed=opts.engine_kwargs.get("seed"), ignore_eos=ignore_eos,
        structured=structured)
    err = stderr_console()
    llm = load_llm(opts, err)
    inputs = _prepare(llm, texts, chat, system)
    t0 = time.perf_counter()
    try:
        with count_progress("generating", err) as progress:
            outputs = llm.generate(inputs, params, progress=progress)
    except GenerationInterrupted as e:  # Ctrl-C: what finished is written, then exit 130
        _write(texts, e.outputs, json_out, err)
        err.print(f"interrupted: {e}; the others are left out"
                  + ("" if json_out is None else ' (finish_reason "interrupted")'),
                  style="dim", markup=False, soft_wrap=True)
        raise typer.Exit(130) from None
    elapsed = time.perf_counter() - t0
    _write(texts, outputs, json_out, err)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    err.print(f"{len(outputs)} prompt(s), {tokens} tokens in {elapsed:.2f} s "
              f"({tokens / elapsed:.1f} tok/s)"
              + _cut_short(outputs, max_tokens, llm.engine.config.scheduler.max_model_len),
              style="dim", soft_wrap=True)


def _write(texts: list[str], outputs: list, json_out: str | None, err: Console) -> None:
    """The completions as text and/or JSON; an output that is None (not finished when
    Ctrl-C came) is left out of the text and recorded as interrupted."""
    records = [_as_json(text, out) for text, out in zip(texts, outputs)]
    if json_out == "-":
        json.dump(records, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        sys.stdout.flush()
        return
    _print_plain(texts, outputs)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(records, indent=2, ensure_ascii=False) + "\n")
        err.print(f"wrote {json_out}", style="dim")


def _cut_short(outputs, max_tokens: int, max_model_len: int) -> str:
    """` · stopped at max tokens (...)`: a completion cut short says so, as chat does,
    and by which limit: --max-tokens, or the context's end (max-model-len) before it."""
    cut = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "length"]
    at_max = sum(len(c.token_ids) >= max_tokens for c in cut)
    said = []
    for count, what in ((at_max, f"stopped at max tokens ({max_tokens}; raise --max-tokens "
                                 "for more)"),
                        (len(cut) - at_max, f"stopped at the context's end (max-model-len "
                                            f"{max_model_len}, prompt included)")):
        if count:
            said.append(what if len(outputs) == 1 else f"{count} of {len(outputs)} {what}")
    return "".join(f" · {s}" for s in said)


def _read_prompts(prompts: list[str], file: Path | None) -> list[str]:
    # A file's blank lines are skipped; a blank argument is a mistake (an unset
    # shell variable), not a prompt.
    blank = [i for i, p in enumerate(prompts, start=1) if not p.strip()]
    if blank:
        raise ValueError(f"prompt argument {blank[0]} is empty")
    texts = list(prompts)
    if file is not None:
        try:
            data = file.read_bytes()
        except OSError as e:
            raise OSError(f"cannot read {file}: {e.strerror or e}") from None
        try:
            content = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{file} is not valid UTF-8 (byte {e.start})") from None
        lines = [line for line in content.splitlines() if line.strip()]
        if not lines:  # "pass them with --file" would tell the user what they just did
            raise ValueError(f"{file} holds no prompts (one per line; blank lines are "
                             "skipped)")
        texts += lines
    if not texts:
        raise ValueError("no prompts: pass them as arguments or with --file")
    return texts


def _prepare(llm, texts: list[str], chat: bool | None, system: str | None) -> list:
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise ValueError(f"{llm.engine.no_tokenizer_reason()}, so it cannot take text prompts")
    use_chat = tokenizer.has_chat_template if chat is None else chat
    if not use_chat:
        if system is not None:  # would be dropped without a word
            raise ValueError("--system needs a chat template, and this model has none")
        return texts
    head = [{"role": "system", "content": system}] if system else []
    # apply_chat_template raises a one-line TokenizerError when asked for a template
    # the model lacks (--chat on such a model).
    return [{"prompt": t, "prompt_token_ids": tokenizer.apply_chat_template(
        head + [{"role": "user", "content": t}], add_generation_prompt=True)} for t in texts]


def _as_json(prompt: str, out) -> dict:
    if out is None:
        return {"prompt": prompt, "text": None, "token_ids": None,
                "finish_reason": "interrupted", "metrics": None}
    completion = out.outputs[0]
    m = out.metrics
    return {
        "prompt": prompt,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "metrics": {
            "ttft_s": m.ttft, "tpot_s": m.tpot, "e2e_s": m.e2e,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "num_output_tokens": len(completion.token_ids),
            "num_cached_tokens": out.num_cached_tokens,
        },
    }


def _print_plain(texts: list[str], outputs) -> None:
    con = Console(highlight=False, soft_wrap=True)
    for i, (prompt, out) in enumerate(zip(texts, outputs)):
        if out is None:
            continue
        if len(texts) > 1:
            title = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            con.print(Rule(Text(f"{i + 1}: {title}"), style="dim"))
        con.file.write(out.outputs[0].text + "\n")  # raw: Rich would drop control characters
        con.file.flush()
