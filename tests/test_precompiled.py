"""A warm start without Dynamo (llmfast/compile/precompiled.py): a cold start saves the
split graph, how to gather its inputs and the pieces' Inductor artifacts; the next start
loads them and never traces. On CPU (Inductor C++) with the tiny random model in
float32, through the CUDA-graph path's CPU stand-in (piece runners, capture, replay).

The oracles: the cold start's own outputs (the same compiled code must give the same
bits) and the eager model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from llmfast.compile import CompiledModel
from llmfast.compile.precompiled import DIRNAME
from llmfast.config import CompileConfig
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import resolve_model
from tests.helpers.compiled import compiled_model
from tests.helpers.paged import MIXED_STEPS, PagedSequences
from tests.helpers.static_batch import StaticBatch

REPO = Path(__file__).resolve().parent.parent
CONFIG = CompileConfig(cuda_graph_sizes=(1, 2, 4, 8, 16))
# Padded to 1, 2, 4, 8 and 16 tokens they replay graphs; 33 tokens run the pieces.
STEPS = MIXED_STEPS


def tiny_model():
    return build_model(resolve_model("random:tiny"), torch.float32, "cpu", seed=0)


def one_allocation(model) -> None:
    """Re-bind the layers' KV caches as views of one tensor, as the runner allocates
    them: their storage offsets differ, which Dynamo traces as symbols."""
    layers = model.attention_layers()
    shape = layers[0].k_cache.shape
    kv = torch.zeros(len(layers), 2, *shape, dtype=layers[0].k_cache.dtype)
    model.bind_kv_caches([(kv[i, 0], kv[i, 1]) for i in range(len(layers))])


def run_steps(cm: CompiledModel | None, model) -> list[torch.Tensor]:
    """STEPS through `cm` (captured first) as the runner feeds it, or eagerly (None)."""
    batch = StaticBatch(model, 4, 64, 64)
    one_allocation(model)
    if cm is None:
        return [batch.step(chunks, model) for chunks in STEPS]
    cm.graphs.capture(batch.dummy_runner(cm))
    return [batch.step(chunks, cm, cm.graphs.padded_num_tokens) for chunks in STEPS]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("llmfast_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMFAST_CACHE", str(root))
        mp.delenv("LLMFAST_PRECOMPILED", raising=False)
        yield root


@pytest.fixture(scope="module")
def cold(cache_root):
    """The cold start: (CompiledModel, its logits per step, the eager model's)."""
    model = tiny_model()
    cm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
    return cm, run_steps(cm, model), run_steps(None, tiny_model())


def _entry(cm: CompiledModel) -> Path:
    assert cm._precompiled_dir is not None and cm._precompiled_dir.parent.name == DIRNAME
    return cm._precompiled_dir


def test_cold_start_traces_and_saves_every_input_by_name(cold):
    cm, logits, eager = cold
    assert cm.stats.num_dynamo_graphs == 1 and not cm.stats.precompiled
    for got, want in zip(logits, eager):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    manifest = json.loads((_entry(cm) / "manifest.json").read_text())
    model = tiny_model()
    layers = model.config.num_hidden_layers
    kinds = Counter(slot["kind"] for slot in manifest["slots"])
    assert kinds["arg"] == 2  # input_ids, positions
    # Every AttentionMetadata field the graph reads (max_query_len only where RoPE fuses
    # into the attention op: not on the CPU).
    assert {s["name"] for s in manifest["slots"] if s["kind"] == "metadata"} == {
        "slot_mapping", "block_table", "query_start_loc", "seq_lens"}
    assert kinds["attr"] == 2 * layers  # the KV caches: read at each call
    constants = {name for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    const_slots = [slot["name"] for slot in manifest["slots"] if slot["kind"] == "const"]
    assert const_slots and set(const_slots) <= constants
    assert kinds["size"] >= 1  # the unbacked token count, at least
    # A model with one KV-cache group leaves the per-group fields None.
    assert manifest["none_fields"] == ["group_slot_mappings", "group_block_tables"]
    pieces = manifest["pieces"]
    assert len(pieces) == cm.stats.num_pieces == layers + 1
    assert manifest["num_artifacts"] == len({p["artifact"] for p in pieces})
    assert all(p["token_index"] is not None for p in pieces)
    assert {f"piece-{i}.bin" for i in range(manifest["num_artifacts"])} <= {
        p.name for p in _entry(cm).iterdir()}


def test_warm_start_in_process_never_traces(cold, monkeypatch):
    import torch._dynamo.convert_frame as convert_frame

    def no_tracing(*args, **kwargs):
        raise AssertionError("Dynamo traced a frame on a warm start")

    monkeypatch.setattr(convert_frame, "_compile", no_tracing)
    cold_cm, cold_logits, _ = cold
    model = tiny_model()
    cm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
    logits = run_steps(cm, model)
    assert cm.stats.precompiled and cm.stats.num_dynamo_graphs == 0
    assert "loaded without tracing" in cm.stats.summary()
    for got, want in zip(logits, cold_logits):
        assert torch.equal(got, want)  # the same compiled code on the same inputs
    # The same piece runners and graphs as the cold start's, replayed alike.
    assert cm.stats.num_pieces == cold_cm.stats.num_pieces
    assert cm.stats.piece_kinds == cold_cm.stats.piece_kinds
    assert cm.graphs.piecewise.num_graphs == cold_cm.graphs.piecewise.num_graphs
    assert cm.graphs.piecewise.num_replays == cold_cm.graphs.piecewise.num_replays > 0


def test_compile_workers_are_started_only_where_a_trace_is_coming(cold, monkeypatch):
    """Inductor's compile workers (compile/workers.py) are asked for at construction
    when nothing saved could be loaded, and again when the first call traces; a warm
    start that loads the saved model never asks (on CUDA that would start processes
    it never uses). (Before the tests that damage or mark the saved entry.)"""
    from llmfast.compile import compiled_model as compiled_model_module

    asked: list[torch.device] = []
    monkeypatch.setattr(compiled_model_module, "start_compile_workers", asked.append)
    model = tiny_model()
    warm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
    run_steps(warm, model)
    assert warm.stats.precompiled and asked == []

    model = tiny_model()
    traced = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated",
                           precompile=False)
    assert asked == [torch.device("cpu")]
    run_steps(traced, model)
    assert not traced.stats.precompiled and asked == [torch.device("cpu")] * 2

def test_warm_start_reads_the_kv_caches_bound_at_each_call(cold):
    """The caches may be re-bound (the memory profile's scratch cache, then the real
    one): the loaded graph must read the layers' current caches, not the
    ones bound when it was loaded. Re-bound here to zeroed copies mid-run, in the warm
    model and the eager one alike: the history they hold is gone for both."""
    model, eager_model = tiny_model(), tiny_model()
    cm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
    batch, eager = StaticBatch(model, 4, 64, 64), StaticBatch(eager_model, 4, 64, 64)
    cm.graphs.capture(batch.dummy_runner(cm))
    assert cm.stats.precompiled
    for i, chunks in enumerate(STEPS):
        if i == 3:
            for m in (model, eager_model):
                m.bind_kv_caches([(layer.k_cache.clone().zero_(), layer.v_cache.clone().zero_())
                                  for layer in m.attention_layers()])
        torch.testing.assert_close(batch.step(chunks, cm, cm.graphs.padded_num_tokens),
                                   eager.step(chunks, eager_model), atol=1e-5, rtol=1e-5)


_WARM_START = textwrap.dedent("""
    import sys
    import torch
    import torch._dynamo.convert_frame as convert_frame
    from tests.test_precompiled import CONFIG, run_steps, tiny_model
    from tests.helpers.compiled import compiled_model

    def no_tracing(*args, **kwargs):
        raise AssertionError("Dynamo traced a frame on a warm start")

    convert_frame._compile = no_tracing
    model = tiny_model()
    cm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
    logits = run_steps(cm, model)
    assert cm.stats.precompiled and cm.stats.num_dynamo_graphs == 0, cm.stats
    torch.save(logits, sys.argv[1])
""")


def test_warm_start_in_a_new_process_gives_the_cold_start_bits(cold, cache_root, tmp_path):
    """The real warm start: a fresh process, Inductor's in-memory caches empty, the
    artifacts loaded from disk."""
    _, cold_logits, _ = cold
    out = tmp_path / "logits.pt"
    env = {**os.environ, "LLMFAST_CACHE": str(cache_root), "PYTHONPATH": str(REPO)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", _WARM_START, str(out)], cwd=REPO, env=env,
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for got, want in zip(torch.load(out), cold_logits):
        assert torch.equal(got, want)


def _with_none_fields(cm: CompiledModel, fields: list[str]) -> str:
    """Make the saved entry claim it was traced with `fields` None; returns the
    manifest as it was."""
    manifest = _entry(cm) / "manifest.json"
    saved = manifest.read_text()
    manifest.write_text(json.dumps({**json.loads(saved), "none_fields": fields}))
    return saved


def test_a_first_call_unlike_the_trace_traces_again_and_replaces_the_entry(cold, caplog):
    """An entry traced with max_query_len None, met by a first call that sets it: the
    start traces with Dynamo, as its guard would, and saves its own trace instead."""
    cold_cm, cold_logits, _ = cold
    saved = _with_none_fields(cold_cm, ["max_query_len"])
    model = tiny_model()
    cm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
    logits = run_steps(cm, model)
    assert "ignoring the precompiled model" in caplog.text
    assert not cm.stats.precompiled and cm.stats.num_dynamo_graphs == 1
    for got, want in zip(logits, cold_logits):
        assert torch.equal(got, want)
    assert (_entry(cm) / "manifest.json").read_text() == saved  # this call's trace


def test_a_later_call_unlike_the_trace_falls_back_to_dynamo(cold, caplog):
    """Loaded for a first call without max_query_len; a later call sets it: before any
    piece runs, the model falls back to Dynamo's trace, and carries on correctly."""
    cold_cm, _, _ = cold
    saved = _with_none_fields(cold_cm, ["max_query_len"])
    model, eager_model = tiny_model(), tiny_model()
    cm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64)
    calls = []

    def forward(ids, positions, md):
        if calls:  # from the second call on
            md = dataclasses.replace(md, max_query_len=torch.ones(1, dtype=torch.int32))
        calls.append(cm.stats.precompiled)
        return cm(ids, positions, md)

    # Blocks of 16 tokens, as the cold start's: the same fingerprint.
    seqs = PagedSequences(model, 4, 64, block_size=16, forward=forward)
    eager = PagedSequences(eager_model, 4, 64, block_size=16)
    try:
        for chunks in STEPS[:4]:
            torch.testing.assert_close(seqs.step(chunks), eager.step(chunks),
                                       atol=1e-5, rtol=1e-5)
    finally:
        (_entry(cold_cm) / "manifest.json").write_text(saved)
    assert calls[1] is True  # the first call ran the loaded model
    assert "does not fit this call" in caplog.text
    assert not cm.stats.precompiled and cm.stats.num_dynamo_graphs == 1
    assert cm.backend.last_trace is None  # nothing held, nothing saved over the entry


def test_a_model_unlike_the_traced_one_is_not_given_its_graph(cold, caplog):
    """Should the directory's key and fingerprint miss something that changes the
    model's inputs (here: the trace claims a bfloat16 weight), the loaded graph is held
    against the first call's inputs and refused."""
    cold_cm, _, _ = cold
    manifest = _entry(cold_cm) / "manifest.json"
    saved = manifest.read_text()
    data = json.loads(saved)
    const = next(i for i, slot in enumerate(data["slots"]) if slot["kind"] == "const")
    data["patterns"][const]["dtype"] = "torch.bfloat16"
    manifest.write_text(json.dumps(data))
    try:
        model = tiny_model()
        cm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
        run_steps(cm, model)
    finally:
        manifest.write_text(saved)
    assert "traced for other inputs" in caplog.text
    assert not cm.stats.precompiled and cm.stats.num_dynamo_graphs == 1


def test_inputs_are_checked_against_the_trace(cold):
    """`bind_slots`: a call's value None where the trace had a tensor, or a value where
    it had None, is refused before anything runs."""
    from llmfast.attention.metadata import AttentionMetadata
    from llmfast.compile.graph_inputs import InputsChanged, InputSlot, bind_slots

    model = tiny_model()
    slots = [InputSlot("arg", "input_ids"), InputSlot("metadata", "seq_lens"),
             InputSlot("size", attr="size", index=0, dim=0),
             InputSlot("const", "model.norm.weight")]
    ids, lens = torch.arange(3), torch.ones(2, dtype=torch.int32)
    md = AttentionMetadata(torch.zeros(3, dtype=torch.long), torch.zeros(2, 1, dtype=torch.int32),
                           torch.zeros(3, dtype=torch.int32), lens)
    flatten = bind_slots(slots, model, none_fields=("max_query_len",))
    got = flatten(ids, ids, md)
    assert got[0] is ids and got[1] is lens and got[2] == 3
    assert got[3] is model.model.norm.weight
    md.max_query_len = torch.ones(1, dtype=torch.int32)
    with pytest.raises(InputsChanged, match="max_query_len"):
        flatten(ids, ids, md)
    md.max_query_len, md.seq_lens = None, None
    with pytest.raises(InputsChanged, match="seq_lens"):
        flatten(ids, ids, md)


def test_off_switch(cold, monkeypatch):
    monkeypatch.setenv("LLMFAST_PRECOMPILED", "0")
    cm = compiled_model(tiny_model(), CONFIG, "cpu", max_num_tokens=64)
    assert cm._precompiled_dir is None and not cm.backend.keep_artifacts


def test_a_damaged_entry_is_traced_again_and_replaced(cold, caplog):
    cold_cm, cold_logits, _ = cold
    manifest = _entry(cold_cm) / "manifest.json"
    saved = json.loads(manifest.read_text())
    (_entry(cold_cm) / "graph.pkl").write_bytes(b"not a graph")
    model = tiny_model()
    cm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
    logits = run_steps(cm, model)
    assert "ignoring the precompiled model" in caplog.text
    assert cm.stats.num_dynamo_graphs == 1 and not cm.stats.precompiled
    for got, want in zip(logits, cold_logits):
        assert torch.equal(got, want)
    assert json.loads(manifest.read_text()) == saved  # saved again, the same


def test_a_loaded_model_failing_on_its_first_call_is_not_tried_again(cold, caplog,
                                                                      monkeypatch):
    """Whatever the checks miss and the loaded code itself raises at the first call
    (here: what Inductor's size asserts raise): the start traces with Dynamo (nothing
    the failed call ran is kept), and this configuration traces from then on instead of
    loading and failing first at every start."""
    import llmfast.compile.backend as backend

    def failing(piece, fn):
        def call(*args):
            raise AssertionError("expected size 96==128")
        return call

    cold_cm, cold_logits, _ = cold
    with monkeypatch.context() as patch:
        patch.setattr(backend, "_as_piece_returns", failing)
        model = tiny_model()
        cm = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
        logits = run_steps(cm, model)
    marker = _entry(cold_cm).with_name(_entry(cold_cm).name + ".failed")
    try:
        assert "failed on its first call" in caplog.text and "96==128" in caplog.text
        assert cm.stats.num_dynamo_graphs == 1 and not cm.stats.precompiled
        assert len(cm.graphs.piecewise.runners) == cm.stats.num_pieces  # Dynamo's alone
        for got, want in zip(logits, cold_logits):
            assert torch.equal(got, want)
        assert "96==128" in marker.read_text() and not _entry(cm).exists()
        # The next start traces without trying (nothing to load, nothing saved).
        model = tiny_model()
        again = compiled_model(model, CONFIG, "cpu", max_num_tokens=64, graph_impl="emulated")
        for got, want in zip(run_steps(again, model), cold_logits):
            assert torch.equal(got, want)
        assert again.stats.num_dynamo_graphs == 1 and not _entry(again).exists()
    finally:
        marker.unlink(missing_ok=True)


def test_the_fingerprint_separates_what_the_trace_is_specialised_to():
    from llmfast.compile.graph_inputs import model_fingerprint

    def with_caches(model, block_size: int = 16):
        StaticBatch(model, 4, 64, 64, block_size)
        one_allocation(model)
        return model

    fingerprint = model_fingerprint(with_caches(tiny_model()))
    other = with_caches(tiny_model())
    assert model_fingerprint(other) == fingerprint  # another process, the same model
    one_allocation(other)  # new caches of the same kind (the real after the scratch)
    assert model_fingerprint(other) == fingerprint
    # A plain int attribute: Dynamo bakes it in (a tensor-parallel rank's vocab offset).
    other.model.embed_tokens.vocab_offset_for_test = 7
    assert model_fingerprint(other) != fingerprint
    # Another block size in the KV caches.
    assert model_fingerprint(with_caches(tiny_model(), block_size=8)) != fingerprint
    # A longer RoPE table (another max_model_len).
    longer = build_model(resolve_model("random:tiny"), torch.float32, "cpu", seed=0,
                         max_positions=512)
    assert model_fingerprint(with_caches(longer)) != fingerprint


def test_no_precompiling_where_asked_not_to(cache_root):
    cm = compiled_model(tiny_model(), CONFIG, "cpu", max_num_tokens=64, precompile=False)
    assert cm._precompiled_dir is None and not cm.backend.keep_artifacts

