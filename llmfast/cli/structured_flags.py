"""`generate`'s output constraints (--json-schema, --regex, --choice, --grammar) made
into a checked `StructuredOutputs` before the model loads: a bad file, schema, regex or
grammar is a one-line error naming the flag."""

from __future__ import annotations

from pathlib import Path

import typer

from llmfast.structured_params import StructuredOutputs, StructuredOutputsError


def _read(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise typer.BadParameter(f"cannot read {path}: {getattr(e, 'strerror', None) or e}",
                                 param_hint=flag) from None


def structured_flags(json_schema: Path | None, regex: str | None, choice: str | None,
                     grammar: Path | None) -> StructuredOutputs | None:
    given = {flag: value for flag, value in (("'--json-schema'", json_schema),
                                             ("'--regex'", regex), ("'--choice'", choice),
                                             ("'--grammar'", grammar)) if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise typer.BadParameter("takes one output constraint at a time, got "
                                 + " and ".join(given), param_hint=next(iter(given)))
    flag = next(iter(given))
    from llmfast.structured.grammars import check_structured

    try:
        if json_schema is not None:
            spec = StructuredOutputs(json=_read(json_schema, flag))
        elif regex is not None:
            spec = StructuredOutputs(regex=regex)
        elif choice is not None:
            spec = StructuredOutputs(choice=[c.strip() for c in choice.split(",") if c.strip()]
                                     or [])
        else:
            spec = StructuredOutputs(grammar=_read(grammar, flag))
        check_structured(spec)
    except StructuredOutputsError as e:
        raise typer.BadParameter(str(e), param_hint=flag) from None
    return spec
