"""Readers for values people type into flags: size lists (`1..512`, `8..64:8`, `1,2,4,8`)
and byte counts (`512MiB`). Pure Python, so the engine arguments, the CLI and the bench
package share one meaning of each without importing one another.
"""

from __future__ import annotations

import math
import re

# More than this many tokens or sequences in one size is a typo, not a setting.
MAX_SIZE = 65536

SIZES_HELP = "a..b doubles from a up to b (1..8 = 1,2,4,8), a..b:s steps by s, a,b,c lists; " \
             "items mix (1,2,8..64:8)"


class FlagValueError(ValueError):
    """A flag value that cannot be read; the message is one user-facing line."""


_RANGE = re.compile(r"^(\d+)\.\.(\d+)(?::(\d+))?$")


def parse_sizes(spec: str, *, flag: str = "--sizes", limit: int = MAX_SIZE) -> tuple[int, ...]:
    """Sizes from a spec, sorted and without duplicates.

    `1..512` doubles from 1 up to 512 (1, 2, 4, ..., 512); `3..20` gives 3, 6, 12; `8..64:8`
    steps by 8 (8, 16, ..., 64); `1,8,64` lists; items mix: `1,2,8..32:8`.
    """
    if not spec or not spec.strip():
        raise FlagValueError(f"empty {flag}; use e.g. 1..512, 8..64:8 or 1,8,64")
    where = f"{flag} {spec!r}"
    sizes: set[int] = set()
    for item in (part.strip() for part in spec.split(",")):
        sizes.update(_parse_size_item(item, where, limit))
    too_big = max(sizes)
    if too_big > limit:
        raise FlagValueError(f"size {too_big} in {where} is above the limit {limit}")
    return tuple(sorted(sizes))


def _parse_size_item(item: str, where: str, limit: int) -> list[int]:
    if item.isdigit():
        value = int(item)
        if value < 1:
            raise FlagValueError(f"sizes must be >= 1, got {value} in {where}")
        return [value]
    match = _RANGE.match(item)
    if match is None:
        raise FlagValueError(
            f"cannot parse {item!r} in {where}; use e.g. 1..512, 8..64:8 or 1,8,64")
    start, stop = int(match[1]), int(match[2])
    if start < 1:
        raise FlagValueError(f"sizes must be >= 1, got {start} in {where}")
    if start > stop:
        raise FlagValueError(f"range {item!r} in {where} runs backwards ({start} > {stop})")
    if stop > limit:  # checked before expanding so `1..10**12:1` stays cheap
        raise FlagValueError(f"size {stop} in {where} is above the limit {limit}")
    if match[3] is None:  # doubling: 1..512 -> 1, 2, 4, ..., 512
        return [start << k for k in range(int(math.log2(stop / start)) + 1)]
    step = int(match[3])
    if step < 1:
        raise FlagValueError(f"the step in {item!r} must be >= 1")
    return list(range(start, stop + 1, step))


_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """`512MiB`, `2GiB`, `1.5GB` (decimal), `512M` (binary), or plain bytes."""
    match = _BYTES.match(text)
    unit = (match[2] or "").lower() if match else None
    if match is None or unit not in _UNITS:
        raise FlagValueError(
            f"cannot read {text!r} as a size; use e.g. 512MiB, 2GiB or a number of bytes")
    value = int(float(match[1]) * _UNITS[unit])
    if value <= 0:
        raise FlagValueError(f"the size must be > 0, got {text!r}")
    return value


# Characters a file name hardly holds and a Jinja template always does (vLLM's rule).
_TEMPLATE_CHARS = frozenset("{}\n")


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja chat template, or the template itself."""
    from llmfast.utils.paths import expand_user

    try:
        path = expand_user(value, "--chat-template")
    except ValueError:  # "~user..." of no user: an inline template, or the error below
        if _TEMPLATE_CHARS.isdisjoint(value):
            raise
        path = None
    try:
        is_file = path is not None and path.is_file()
    except OSError:  # e.g. "File name too long": an inline template, not a path
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise FlagValueError(f"cannot read the chat template {value!r}: {e}") from None
        if not text.strip():
            raise FlagValueError(f"the chat template file {value!r} is empty")
        return text
    if _TEMPLATE_CHARS.isdisjoint(value):
        raise FlagValueError(f"the chat template {value!r} is neither a file nor a Jinja "
                             "template")
    return value
