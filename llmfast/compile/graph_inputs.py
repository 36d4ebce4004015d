"""Where each input of the traced graph comes from, so that a warm start can call the
compiled graph without Dynamo (compile/precompiled.py).

Dynamo flattens a call `forward(input_ids, positions, attn_metadata)` of the model into
the graph's placeholders: the call's tensors, the metadata's fields, every parameter and
buffer, the attention layers' KV caches (plain tensor attributes, re-bound after the
memory profile) and the unbacked token count. The backend sees the real objects
(`example_inputs`); matching them by identity against what the call and the model hold
names each one:

    slot kind  name                                  resolved
    arg        "input_ids"                           per call
    metadata   "slot_mapping"                        per call (a field of attn_metadata;
                                                  with `index`, that entry of a tuple
                                                  field: a KV-cache group's table)
    const      "model.layers.0.mlp.down_proj.weight" once (parameters and buffers)
    attr       "model.layers.0.self_attn" + "k_cache" per call (may be re-bound)
    size       "size" of slot 2, dim 0               per call (a size, stride or storage
                                                  offset of another slot)

Worked example (smollm2, 30 layers): 314 placeholders = 64 symbolic ints (the token,
request, block-table and block counts, and the KV-cache views' storage offsets) + 2 args
+ 4 metadata fields + 60 KV caches + 184 constants.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from llmfast.attention.metadata import AttentionMetadata

# (input_ids, positions, attn_metadata) -> the graph's flat arguments
Flatten = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], list[Any]]

CALL_ARGS = ("input_ids", "positions")


@dataclasses.dataclass(frozen=True)
class InputSlot:
    kind: str  # "arg", "metadata", "const", "attr" or "size" (see the module docstring)
    name: str = ""  # arg / field name, or the module path ("" for the model itself)
    attr: str = ""  # "attr": the attribute of the module at `name`; "size": "size",
    # "stride" or "offset"
    index: int = -1  # "size": the slot whose size, stride or offset this is
    dim: int = -1

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v != getattr(InputSlot, k, None) or k == "kind"}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputSlot:
        return cls(**data)


def _sources(model: nn.Module, call: Sequence[Any]) -> dict[int, InputSlot]:
    """id(object) -> the slot naming it, for every tensor a traced call can read."""
    input_ids, positions, md = call
    found: dict[int, InputSlot] = {}
    for name, value in zip(CALL_ARGS, (input_ids, positions)):
        found.setdefault(id(value), InputSlot("arg", name))
    for field in dataclasses.fields(md):
        value = getattr(md, field.name)
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), InputSlot("metadata", field.name))
        elif isinstance(value, tuple):  # per KV-cache group: entry `index` of the field
            for index, item in enumerate(value):
                found.setdefault(id(item), InputSlot("metadata", field.name, index=index))
    for name, tensor in _constants(model):
        found.setdefault(id(tensor), InputSlot("const", name))
    for path, attr, value in _attributes(model):
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), InputSlot("attr", path, attr))
    return found


def _attributes(model: nn.Module) -> Iterator[tuple[str, str, Any]]:
    """(module path, name, value) of every module's own instance attributes: the plain
    tensors (KV caches) a trace reads, the scalars it bakes in."""
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            yield path, attr, value


def _constants(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by name (tied ones under each name)."""
    return [*model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False)]


def _symbol(value: Any) -> str | None:
    return str(value.node.expr) if isinstance(value, torch.SymInt) else None


def _find_symbol(fake: torch.Tensor, symbol: str) -> tuple[str, int] | None:
    """("size" | "stride", dim) or ("offset", 0) of `fake` that is `symbol`."""
    for what, values in (("size", fake.shape), ("stride", fake.stride())):
        for dim, value in enumerate(values):
            if _symbol(value) == symbol:
                return what, dim
    if _symbol(fake.storage_offset()) == symbol:
        return "offset", 0
    return None


def record_slots(gm: fx.GraphModule, example_inputs: Sequence[Any], model: nn.Module,
                 call: Sequence[Any]) -> list[InputSlot] | None:
    """The slot of each of `gm`'s placeholders (Dynamo's graph, `example_inputs` the real
    objects it was called with), or None when one cannot be named: the graph then stays
    Dynamo's alone."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return None
    sources = _sources(model, call)
    slots: list[InputSlot | None] = []
    for value in example_inputs:
        slots.append(sources.get(id(value)) if isinstance(value, torch.Tensor) else None)
    # Symbolic ints: each is a size, stride or storage offset of some tensor placeholder
    # (the unbacked token count is input_ids.shape[0]; the layers' KV caches, views of one
    # tensor, have symbolic offsets); find one whose traced tensor holds the same symbol.
    for i, node in enumerate(placeholders):
        if slots[i] is not None:
            continue
        symbol = _symbol(node.meta.get("example_value"))
        if symbol is None:
            return None
        for j, other in enumerate(placeholders):
            fake = other.meta.get("example_value")
            if slots[j] is None or slots[j].kind == "size" or not isinstance(fake, torch.Tensor):
                continue
            found = _find_symbol(fake, symbol)
            if found is not None:
                slots[i] = InputSlot("size", attr=found[0], index=j, dim=found[1])
                break
        else:
            return None
    return [slot for slot in slots if slot is not None] if all(slots) else None


def _walk(root: nn.Module, dotted: str) -> Any:
    obj: Any = root
    for part in dotted.split(".") if dotted else ():
        obj = getattr(obj, part)
    return obj


def bind_slots(slots: Sequence[InputSlot], model: nn.Module,
               none_fields: Sequence[str] = ()) -> Flatten:
    """A function from a call's arguments to the graph's flat arguments: constants looked
    up now, everything else at each call (the KV caches may be re-bound). It raises
    `InputsChanged` for a call unlike the traced one: a slot's value None, or one of
    the metadata fields that were None when traced (`none_fields`) set."""
    template: list[Any] = [None] * len(slots)
    per_call: list[tuple[int, Callable[..., Any]]] = []
    sizes: list[tuple[int, int, int, str]] = []
    for i, slot in enumerate(slots):
        if slot.kind == "const":
            template[i] = _walk(model, slot.name)
        elif slot.kind == "arg":
            position = CALL_ARGS.index(slot.name)
            per_call.append((i, lambda ids, pos, md, p=position: (ids, pos)[p]))
        elif slot.kind == "metadata" and slot.index >= 0:  # a per-group tuple's entry
            per_call.append((i, lambda ids, pos, md, f=slot.name, k=slot.index:
                             _entry(getattr(md, f), k)))
        elif slot.kind == "metadata":
            per_call.append((i, lambda ids, pos, md, f=slot.name: getattr(md, f)))
        elif slot.kind == "attr":
            module = _walk(model, slot.name)
            per_call.append((i, lambda ids, pos, md, m=module, a=slot.attr: getattr(m, a)))
        elif slot.kind == "size":
            sizes.append((i, slot.index, slot.dim, slot.attr))
        else:
            raise ValueError(f"unknown graph input kind {slot.kind!r}")

    def flatten(input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata) -> list[Any]:
        args = template.copy()
        for i, get in per_call:
            value = get(input_ids, positions, md)
            if value is None:  # e.g. max_query_len: traced as a tensor, absent here
                raise InputsChanged(f"graph input {slots[i]} is None in this call")
            args[i] = value
        for i, j, dim, what in sizes:
            tensor = args[j]
            args[i] = (tensor.shape[dim] if what == "size" else tensor.stride(dim)
                       if what == "stride" else tensor.storage_offset())
        for name in none_fields:
            if getattr(md, name) is not None:
                raise InputsChanged(f"attention metadata field {name!r} was None when traced")
        return args

    return flatten


def _entry(values: tuple | None, index: int) -> Any:
    """values[index], or None where the call has no such tuple (InputsChanged then)."""
    return None if values is None or index >= len(values) else values[index]


_SCALARS = (bool, int, float, str)


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of what the model's traced graph is specialised to beyond the
    compile cache's key, for one saved trace per configuration (two under one key do
    not then take turns replacing each other's):

    - every parameter's and buffer's name, dtype, device (with its index: Inductor's
      code sets it) and shape: a max_model_len sizes the RoPE table, a quantization or
      a tensor-parallel shard the weights;
    - every other tensor attribute's dtype, device and sizes but the first (the KV
      caches: block size, heads, head dim; their block count is left free);
    - every plain int, float, str or bool attribute of every module: Dynamo bakes them
      into the graph as constants (a tensor-parallel rank's vocabulary offset)."""
    parts = [f"{name} {t.dtype} {t.device} {tuple(t.shape)}" for name, t in _constants(model)]
    for path, attr, value in _attributes(model):
        if isinstance(value, torch.Tensor):
            parts.append(f"{path}.{attr} {value.dtype} {value.device} "
                         f"{tuple(value.shape[1:])}")
        elif isinstance(value, _SCALARS) and not attr.startswith("_"):
            parts.append(f"{path}.{attr} = {value!r}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _static(values: Sequence[Any]) -> list[int | None]:
    return [v if type(v) is int else None for v in values]


def input_patterns(traced: Sequence[Any]) -> list[dict[str, Any]]:
    """What the traced graph assumed of each input (the values Dynamo traced, fake
    tensors and symbolic ints): a tensor's dtype, device, and its sizes and strides
    where the trace fixed them (None where they are symbolic). Inductor's code asserts
    those sizes and strides; Dynamo would have guarded on them all."""
    out: list[dict[str, Any]] = []
    for value in traced:
        if isinstance(value, torch.Tensor):
            out.append({"dtype": str(value.dtype), "device": str(value.device),
                        "shape": _static(value.shape), "stride": _static(value.stride())})
        else:
            out.append({"type": "int"})
    return out


def _fits(pattern: dict[str, Any], value: Any) -> bool:
    if "type" in pattern:
        return type(value) is int
    if not isinstance(value, torch.Tensor) or str(value.dtype) != pattern["dtype"] \
            or str(value.device) != pattern["device"] or value.dim() != len(pattern["shape"]):
        return False
    return all(want is None or got == want
               for key, got_all in (("shape", value.shape), ("stride", value.stride()))
               for got, want in zip(got_all, pattern[key]))


def first_unfit(patterns: Sequence[dict[str, Any]], flat: Sequence[Any]) -> int | None:
    """The first input of a call that the traced graph's `input_patterns` do not
    admit, or None."""
    if len(patterns) != len(flat):
        return min(len(patterns), len(flat))
    return next((i for i, (p, v) in enumerate(zip(patterns, flat)) if not _fits(p, v)), None)


def first_mismatch(flat: Sequence[Any], example_inputs: Sequence[Any]) -> int | None:
    """The first position where the gathered arguments differ from what Dynamo passed:
    a tensor that is not the same object, or an int other than the symbol's value
    (unbacked symbols have none to compare: their tensors' sizes are checked instead).
    None when they agree."""
    if len(flat) != len(example_inputs):
        return min(len(flat), len(example_inputs))
    for i, (got, want) in enumerate(zip(flat, example_inputs)):
        if isinstance(want, torch.Tensor):
            if got is not want:
                return i
        elif isinstance(want, torch.SymInt):
            hint = getattr(want.node, "hint", None)
            if hint is not None and got != hint:
                return i
        elif got != want:
            return i
    return None


class InputsChanged(RuntimeError):
    """A call whose inputs differ in kind from the traced call's."""
