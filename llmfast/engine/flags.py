"""The engine flags, read from `EngineArgs`' fields: what every engine command's Engine
panel and `--help` are built from, and the way back from flags as typed to keywords."""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

from llmfast.config import ConfigError
from llmfast.engine.arg_checks import plain_type
from llmfast.engine.args import EngineArgs



@dataclass(frozen=True)
class EngineFlag:
    """One `EngineArgs` field as a command-line option (what the CLI builds from)."""

    name: str  # the field
    decls: tuple[str, ...]  # Typer declarations: ("--model", "-m") or ("--compile/--no-compile",)
    help: str
    value_type: type  # what the option's text is converted to before `parse`
    parse: Callable[[str], Any] | None
    default: Any  # the field's default

    @property
    def is_bool(self) -> bool:
        return self.value_type is bool

    @property
    def names(self) -> tuple[str, ...]:
        """Every spelling on the command line: --compile, --no-compile; --model, -m."""
        return tuple(name for decl in self.decls for name in decl.split("/"))

    def to_argv(self, value: Any) -> list[str]:
        """The arguments that set this field to `value` (the inverse of parsing)."""
        if self.is_bool:
            on, off = self.decls[0].split("/")
            return [on if value else off]
        if isinstance(value, tuple):
            value = ",".join(map(str, value))
        return [self.decls[0], str(value)]


@functools.cache
def engine_flags() -> tuple[EngineFlag, ...]:
    """The engine flags, in field order (the order of `--help`)."""
    hints = typing.get_type_hints(EngineArgs)
    flags = []
    for f in fields(EngineArgs):
        meta = f.metadata
        value_type = plain_type(hints[f.name])
        if meta["parse"] is not None:
            value_type = str
        elif value_type not in (str, int, float, bool):
            raise TypeError(f"EngineArgs.{f.name}: a {value_type} field needs parse=")
        option = "--" + f.name.replace("_", "-")
        if value_type is bool:
            option += "/--no-" + f.name.replace("_", "-")
        decls = meta["flags"] or (option,)
        help_text = meta["help"]
        if "[default:" not in help_text and f.default is not MISSING:
            shown = ("on" if f.default else "off") if value_type is bool else f.default
            help_text += f"  [default: {shown}]"
        flags.append(EngineFlag(f.name, decls, help_text, value_type, meta["parse"], f.default))
    return tuple(flags)


def engine_kwargs_from_argv(argv: Sequence[str]) -> dict[str, Any]:
    """EngineArgs keywords from engine flags as typed ("--max-num-seqs 64 --no-compile",
    split): what `EngineFlag.to_argv` writes, read back, for scripts that pass a server's
    flags on to an in-process engine. ConfigError names a flag that is not one."""
    by_name = {name: flag for flag in engine_flags() for name in flag.names}
    kwargs: dict[str, Any] = {}
    args = list(argv)
    while args:
        name, _, inline = args.pop(0).partition("=")
        flag = by_name.get(name)
        if flag is None:
            raise ConfigError(f"{name!r} is not an engine flag")
        if flag.is_bool:
            kwargs[flag.name] = not name.startswith("--no-")
            continue
        if not inline and not args:
            raise ConfigError(f"{name} needs a value")
        text = inline or args.pop(0)
        try:
            value = flag.value_type(text)
            kwargs[flag.name] = flag.parse(value) if flag.parse is not None else value
        except ValueError as e:
            raise ConfigError(f"{name} {text}: {e}") from None
    return kwargs
