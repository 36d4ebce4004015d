"""The piecewise torch.compile backend, the compile cache and the CUDA-graph bookkeeping,
on CPU (Inductor C++) with the tiny random model in float32.

Inductor compiles cost ~15-40 s cold on this machine, so one module-scoped compiled
model serves most tests, and every compile writes to one temporary compile cache.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from llmfast.attention.metadata import AttentionMetadata
from llmfast.compile import CompiledModel
from llmfast.compile.backend import resolve_splitting_ops
from llmfast.compile.cache import compile_cache_key
from llmfast.config import DEFAULT_CUDA_GRAPH_SIZES, CompileConfig
from llmfast.cuda_graphs.sizes import capture_sizes, pad_num_tokens
from llmfast.attention.ops import unified_attention_impl
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import resolve_model
from tests.helpers.compiled import compiled_model
from tests.helpers.paged import MIXED_STEPS, PagedSequences
from tests.helpers.static_batch import StaticBatch

REPO = Path(__file__).resolve().parent.parent

STEPS = MIXED_STEPS  # token counts 1, 2, 3, 7, 16, 33


def tiny_model():
    return build_model(resolve_model("random:tiny"), torch.float32, "cpu", seed=0)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("llmfast_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMFAST_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def compiled(cache_root):
    """(eager model, compiled model, CompiledModel) after running STEPS through both."""
    eager_model, model = tiny_model(), tiny_model()
    cm = compiled_model(model, CompileConfig(), "cpu", max_num_tokens=64)
    eager_seqs, compiled_seqs = PagedSequences(eager_model, 4, 64), PagedSequences(model, 4, 64)
    compiled_seqs.model = _CallThrough(cm, model)
    results = []
    for i, chunks in enumerate(STEPS):
        # After the first step (the compile) any recompile is an error.
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            results.append((eager_seqs.step(chunks), compiled_seqs.step(chunks)))
    return eager_model, model, cm, results, (eager_seqs, compiled_seqs)


class _CallThrough:
    """Lets PagedSequences call a CompiledModel where it expects the model."""

    def __init__(self, cm: CompiledModel, model) -> None:
        self.cm, self.model = cm, model

    def __call__(self, *args):
        return self.cm(*args)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


# ----------------------------------------------------------------------------- sizes


def test_default_capture_sizes():
    assert DEFAULT_CUDA_GRAPH_SIZES[:5] == (1, 2, 4, 8, 16)
    assert DEFAULT_CUDA_GRAPH_SIZES[-3:] == (480, 496, 512)
    assert 248 in DEFAULT_CUDA_GRAPH_SIZES and 256 in DEFAULT_CUDA_GRAPH_SIZES
    assert capture_sizes(100) == (1, 2, 4) + tuple(range(8, 97, 8))
    assert capture_sizes(2048)[-1] == 512


def test_pad_num_tokens():
    sizes = (1, 2, 4, 8, 16)
    assert [pad_num_tokens(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 100)] == [
        1, 2, 4, 8, 8, 16, 16, 17, 100]
    assert pad_num_tokens(7, ()) == 7


# ----------------------------------------------------------------------------- backend


def test_splitting_ops_match_packet_and_default():
    targets = resolve_splitting_ops(["llmfast::unified_attention"])
    assert torch.ops.llmfast.unified_attention in targets
    assert torch.ops.llmfast.unified_attention.default in targets
    with pytest.raises(ValueError):
        resolve_splitting_ops(["llmfast::no_such_op"])


def test_one_piece_per_attention_gap(compiled):
    _, model, cm, _, _ = compiled
    layers = model.config.num_hidden_layers
    assert cm.stats.piece_kinds == ["compiled", "split"] * layers + ["compiled"]
    assert cm.stats.num_pieces == layers + 1
    assert cm.stats.num_splitting_ops == layers
    split_calls = [n for n in cm.backend.split_gm.graph.nodes if n.op == "call_module"]
    assert len(split_calls) == 2 * layers + 1


def test_split_graph_calls_attention_implementation_directly(compiled):
    _, model, cm, _, _ = compiled
    split = cm.backend.split_gm
    pieces = [split._modules[str(n.target)] for n in split.graph.nodes if n.op == "call_module"]
    targets = [
        node.target for piece in pieces for node in piece.graph.nodes
        if node.op == "call_function"
    ]
    assert targets.count(unified_attention_impl) == model.config.num_hidden_layers
    assert torch.ops.llmfast.unified_attention.default not in targets


def test_compiled_matches_eager_without_recompiles(compiled):
    _, _, cm, results, _ = compiled
    assert [len(e) for e, _ in results] == [1, 2, 3, 7, 16, 33]
    for eager_logits, compiled_logits in results:
        torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5)
    assert cm.stats.num_dynamo_graphs == 1


def test_kv_cache_rebind_does_not_recompile(compiled):
    # A cache bound after the first call (a larger one) needs no recompile.
    eager_model, model, cm, _, _ = compiled
    eager_seqs, seqs = PagedSequences(eager_model, 2, 200), PagedSequences(model, 2, 200)
    seqs.model = _CallThrough(cm, model)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for chunks in ({0: [1, 2, 3], 1: [4]}, {0: [5], 1: [6]}):
            torch.testing.assert_close(seqs.step(chunks), eager_seqs.step(chunks),
                                       atol=1e-5, rtol=1e-5)
    assert cm.stats.num_dynamo_graphs == 1


def test_compile_cache_key_changes_with_inputs(monkeypatch):
    cfg = resolve_model("random:tiny").config
    key = compile_cache_key(cfg, torch.float32, "cpu", CompileConfig())
    assert key == compile_cache_key(cfg, torch.float32, "cpu", CompileConfig())
    assert key != compile_cache_key(cfg, torch.bfloat16, "cpu", CompileConfig())
    assert key != compile_cache_key(cfg, torch.float32, "cuda", CompileConfig())
    from llmfast.kernels.layers import kernel_choice as layer_switch  # LLMFAST_LAYER_KERNELS=0: other pieces

    monkeypatch.setattr(layer_switch, "_ENABLED", not layer_switch.layer_kernels_enabled())
    assert key != compile_cache_key(cfg, torch.float32, "cpu", CompileConfig())
    monkeypatch.undo()
    # Under Triton's interpreter the CPU model traces Triton ops: another graph.
    monkeypatch.setenv("TRITON_INTERPRET", "0" if os.environ.get("TRITON_INTERPRET") == "1" else "1")
    assert key != compile_cache_key(cfg, torch.float32, "cpu", CompileConfig())
    monkeypatch.undo()
    other = resolve_model("random:smollm2-135m").config
    assert key != compile_cache_key(other, torch.float32, "cpu", CompileConfig())


_SECOND_START = textwrap.dedent("""
    import json, torch
    from tests.helpers.compiled import compiled_model
    from llmfast.config import CompileConfig
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.paged import MIXED_STEPS, PagedSequences

    model = build_model(resolve_model("random:tiny"), torch.float32, "cpu", seed=0)
    cm = compiled_model(model, CompileConfig(), "cpu", max_num_tokens=64)
    seqs = PagedSequences(model, 2, 64)
    seqs.model = type("M", (), {"__call__": lambda self, *a: cm(*a),
                                "compute_logits": lambda self, h: model.compute_logits(h)})()
    seqs.step({0: [1, 2, 3], 1: [4]})
    s = cm.stats
    print(json.dumps({"hits": s.cache_hits, "misses": s.cache_misses, "dir": s.cache_dir}))
""")


def test_second_process_hits_compile_cache(compiled, cache_root):
    # The fixture's compile (this process) filled the cache; a fresh process must reuse it.
    _, _, cm, _, _ = compiled
    assert cm.stats.cache_dir is not None and cm.stats.cache_dir.startswith(str(cache_root))
    env = {**os.environ, "LLMFAST_CACHE": str(cache_root), "PYTHONPATH": str(REPO)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", _SECOND_START], cwd=REPO, env=env, check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    if second["dir"] != cm.stats.cache_dir:
        # Same config, so the key differs only if llmfast's sources changed meanwhile
        # (someone editing the tree): then the key must now match the second process's.
        cfg = resolve_model("random:tiny").config
        now = compile_cache_key(cfg, torch.float32, "cpu", CompileConfig())
        assert second["dir"].endswith(now), "compile cache key is not deterministic"
        pytest.skip("llmfast sources changed during the test; cache dir moved")
    assert second["hits"] > 0 and second["misses"] == 0, second


# ----------------------------------------------------------------------------- graphs


def test_emulated_graphs_match_eager_and_leave_padding_out_of_the_cache(cache_root):
    """The CUDA-graph path with a CPU stand-in for CUDAGraph (same static-address
    semantics): capture at padded sizes, replay, pad with slot -1, sizes past the last
    graph run compiled. The KV caches must hold the eager run's slots and values."""
    eager_model, model = tiny_model(), tiny_model()
    config = CompileConfig(cuda_graph_sizes=(1, 2, 4, 8, 16), check_static_addresses=True)
    cm = compiled_model(model, config, "cpu", max_num_tokens=64, graph_impl="emulated")
    eager, static = StaticBatch(eager_model, 4, 64, 64), StaticBatch(model, 4, 64, 64)
    assert cm.graphs.capture(static.dummy_runner(cm)) == 0  # no device memory on CPU
    assert cm.stats.captured_sizes == (1, 2, 4, 8, 16)
    assert cm.stats.num_cuda_graphs == 5 * cm.stats.num_pieces
    for v, _ in static.caches + eager.caches:
        assert not v.any(), "the dummy runs wrote to the KV cache"
    for chunks in STEPS:
        torch.testing.assert_close(static.step(chunks, cm, cm.graphs.padded_num_tokens),
                                   eager.step(chunks, eager_model), atol=1e-5, rtol=1e-5)
    # Steps of 1, 2, 3->4, 7->8 and 16 tokens replay every piece; 33 runs without graphs.
    assert [cm.graphs.padded_num_tokens(n) for n in (1, 2, 3, 7, 16, 33)] == [1, 2, 4, 8, 16, 33]
    assert cm.graphs.piecewise.num_replays == 5 * cm.stats.num_pieces
    # A fresh tensor where a persistent buffer should be: caught, not silently stale.
    ids = static.input_ids[:4].clone()
    static.dummy_runner(lambda *a: None)(4)  # dummy metadata: slot -1, one request
    md = AttentionMetadata(static.slot_mapping[:4], static.table[:1],
                           static.query_start_loc[:2], static.seq_lens[:1])
    with pytest.raises(AssertionError, match="input moved"), torch.inference_mode():
        cm(ids, static.positions[:4], md)
    for (k, v), (ek, ev) in zip(static.caches, eager.caches):
        # Exactly the same slots written (padding wrote none), with the same values.
        assert torch.equal(k.ne(0).flatten(2).any(-1), ek.ne(0).flatten(2).any(-1))
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, ev, atol=1e-5, rtol=1e-5)
    assert cm.stats.num_dynamo_graphs == 1


def test_graphs_survive_binding_the_real_kv_cache_after_capture(cache_root):
    """Capture on one cache, then bind another (the KV cache may move). Pieces
    get caches and metadata only for size checks, so the debug address check must not
    flag them (it did: "input moved ... argument 3"), and replay must use the new cache."""
    from llmfast.cuda_graphs.piecewise import data_arg_indices

    eager_model, model = tiny_model(), tiny_model()
    config = CompileConfig(cuda_graph_sizes=(1, 2, 4, 8, 16), check_static_addresses=True)
    cm = compiled_model(model, config, "cpu", max_num_tokens=64, graph_impl="emulated")
    eager, static = StaticBatch(eager_model, 4, 64, 64), StaticBatch(model, 4, 64, 64)
    cm.graphs.capture(static.dummy_runner(cm))
    # The first piece is handed KV caches (4-d) for their sizes alone: not data.
    first = cm.backend.split_gm._modules["submod_0"]
    placeholders = [n for n in first.graph.nodes if n.op == "placeholder"]
    caches = [i for i, n in enumerate(placeholders) if n.name.endswith(("k_cache", "v_cache"))]
    data = data_arg_indices(first)
    assert caches and not set(caches) & set(data)
    assert all(r.token_index in r.data_args for r in cm.graphs.piecewise.runners)
    real = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in static.caches]
    model.bind_kv_caches(real)
    static.caches = real
    for chunks in STEPS:
        torch.testing.assert_close(static.step(chunks, cm, cm.graphs.padded_num_tokens),
                                   eager.step(chunks, eager_model), atol=1e-5, rtol=1e-5)
    assert cm.graphs.piecewise.num_replays > 0
    assert any(k.any() for k, _ in real), "replays wrote to the old cache"


def test_a_discarded_compiled_model_frees_its_graphs(cache_root):
    """Dynamo keeps what a compile made for the life of the process: the backend in its
    registry of backends, the split graph (with its piece runners) in a global of the
    compiled function's module. So a discarded engine's CUDA graphs and their memory pool
    stayed alive; dropping the CompiledModel must release them."""
    import weakref

    model = tiny_model()
    config = CompileConfig(cuda_graph_sizes=(1, 2, 4))
    cm = compiled_model(model, config, "cpu", max_num_tokens=16, graph_impl="emulated",
                       piece_compiler="eager")
    static = StaticBatch(model, 4, 16, 16)
    cm.graphs.capture(static.dummy_runner(cm))
    runners = cm.graphs.piecewise.runners
    assert runners and all(r.graphs for r in runners)
    # The graphs' static outputs: on CUDA, memory of the graph pool.
    outputs = [weakref.ref(t) for r in runners for g in r.graphs.values()
               for t in (g.outputs if isinstance(g.outputs, (tuple, list)) else [g.outputs])
               if isinstance(t, torch.Tensor)]
    state = weakref.ref(cm.graphs.piecewise)
    assert outputs
    del cm, runners
    gc.collect()
    assert state() is None, "the capture state (the graph pool's owner) outlived its model"
    assert not [ref for ref in outputs if ref() is not None], "graph outputs outlived it"


def test_static_address_check_catches_moved_inputs():
    from llmfast.cuda_graphs.capturers import EmulatedGraphCapturer
    from llmfast.cuda_graphs.piecewise import GraphCaptureState

    state = GraphCaptureState(EmulatedGraphCapturer(torch.device("cpu")),
                              check_static_addresses=True)
    runner = state.wrap(0, lambda x: x * 2, 0, [0])  # arg 0: the token-sized input
    x = torch.ones(4)
    with state.capturing(4):
        runner(x)
    assert torch.equal(runner(x), torch.full((4,), 2.0))  # replay
    with pytest.raises(AssertionError, match="input moved"):
        runner(torch.ones(4))
    assert torch.equal(runner(torch.ones(3)), torch.full((3,), 2.0))  # no graph: direct


def test_enforce_eager_is_a_passthrough():
    model = tiny_model()
    cm = compiled_model(model, CompileConfig(enforce_eager=True), "cpu", max_num_tokens=64)
    assert cm.graphs.padded_num_tokens(3) == 3
    assert cm.graphs.capture(lambda n: None) == 0
    assert cm.stats.num_dynamo_graphs == 0


def test_compiled_models_do_not_share_dynamo_caches():
    # Dynamo's recompile limit is per code object; each CompiledModel has its own, so
    # many models per process (tests, benchmarks) never exhaust a shared one.
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(2):
            model = tiny_model()
            cm = compiled_model(model, CompileConfig(use_compile_cache=False), "cpu",
                               max_num_tokens=64, piece_compiler="eager")
            seqs = PagedSequences(model, 1, 16)
            seqs.model = _CallThrough(cm, model)
            seqs.step({0: [1, 2]})
            assert cm.stats.num_dynamo_graphs == 1


def test_compiled_models_do_not_share_automatic_dynamic_state():
    # Regression: Dynamo's automatic-dynamic ("PGO") state is keyed by (file, first line,
    # name) of the compiled code, so every CompiledModel's forward shared it. A first
    # model fed from 64-token persistent buffers and a second from 32-token ones made
    # the second trace the buffers' *bases* as dynamic, with guards on `x._base.size()`
    # that fail ("'NoneType' object has no attribute 'size'") for a non-view input: a
    # recompile, and for CUDA graphs the static-address check silently skipped.
    for max_num_tokens in (64, 32, 48):
        model = tiny_model()
        cm = compiled_model(model, CompileConfig(use_compile_cache=False), "cpu",
                           max_num_tokens=max_num_tokens, piece_compiler="eager")
        static = StaticBatch(model, 2, 32, max_num_tokens)
        static.step({0: [1, 2, 3], 1: [4]}, cm)
        with torch._dynamo.config.patch(error_on_recompile=True):
            static.step({0: [5], 1: [6]}, cm)
            md = AttentionMetadata(static.slot_mapping[:2].clone(), static.table[:2].clone(),
                                   static.query_start_loc[:3].clone(),
                                   static.seq_lens[:2].clone())
            ids, positions = static.input_ids[:2].clone(), static.positions[:2].clone()
            with torch.inference_mode():
                cm(ids, positions, md)  # fresh tensors, not views of the buffers
        assert cm.stats.num_dynamo_graphs == 1
        del model, cm, static
        gc.collect()


def test_identical_layer_pieces_share_one_compile(monkeypatch):
    # 4 layers: pieces = first (embed .. qkv 0), 3 middles (o_proj, mlp, next qkv), last
    # (o_proj, mlp, final norm). The middles are one function of their inputs (weights
    # included): compiled once, reused twice, and the model still equals eager.
    from dataclasses import replace

    from llmfast.compile import backend
    from llmfast.models.sources.model_source import ModelSource

    config = replace(resolve_model("random:tiny").config, num_hidden_layers=4)
    source = ModelSource("four-layers", None, config)
    eager_model = build_model(source, torch.float32, "cpu", seed=0, max_positions=64)
    model = build_model(source, torch.float32, "cpu", seed=1, max_positions=64)
    model.load_state_dict(eager_model.state_dict())
    compiled_pieces = []

    def compile_piece(piece, args):  # stands in for Inductor: counts, runs the FX code
        compiled_pieces.append((piece, args))
        return piece.forward

    monkeypatch.setattr(backend, "_compile_with_inductor", compile_piece)
    cm = compiled_model(model, CompileConfig(use_compile_cache=False), "cpu", max_num_tokens=64)
    eager_seqs, seqs = PagedSequences(eager_model, 2, 64), PagedSequences(model, 2, 64)
    seqs.model = _CallThrough(cm, model)
    for chunks in ({0: [1, 2, 3], 1: [4, 5]}, {0: [6], 1: [7]}):
        torch.testing.assert_close(seqs.step(chunks), eager_seqs.step(chunks), atol=1e-5, rtol=0)
    assert cm.stats.num_pieces == 5 and cm.stats.num_shared_pieces == 2
    assert len(compiled_pieces) == 3
    signatures = [backend.piece_signature(p, a) for p, a in compiled_pieces]
    assert None not in signatures and len(set(signatures)) == 3
    called = cm.backend.split_gm.__dict__
    assert called["submod_2"] is called["submod_4"] is called["submod_6"]
    assert called["submod_0"] is not called["submod_2"] is not called["submod_8"]


def _tensor_facts(args):
    """What a compiler sees of a piece's fake arguments (symbols included)."""
    return [
        (tuple(map(str, a.shape)), tuple(map(str, a.stride())), str(a.storage_offset()),
         a.dtype, a.device.type, a.requires_grad)
        if isinstance(a, torch.Tensor) else (type(a).__name__, str(a))
        for a in args
    ]


def test_pieces_get_dynamo_traced_args_equal_to_fake_propagated_ones(monkeypatch):
    # The backend hands each piece the fake values Dynamo recorded on its inputs instead
    # of re-running the split graph on fake tensors; the fallback (no recorded values)
    # still propagates. Both must give the compilers the same arguments, and the model
    # must equal eager either way.
    from dataclasses import replace

    from llmfast.compile import backend
    from llmfast.models.sources.model_source import ModelSource

    config = replace(resolve_model("random:tiny").config, num_hidden_layers=3)
    source = ModelSource("three-layers", None, config)
    eager_model = build_model(source, torch.float32, "cpu", seed=0, max_positions=64)
    seen: dict[str, list] = {}
    for mode in ("traced", "propagated"):
        if mode == "propagated":
            monkeypatch.setattr(backend, "traced_piece_args", lambda piece: None)
        calls = seen[mode] = []

        def compile_piece(piece, args, calls=calls, mode=mode):
            if mode == "traced":  # the very objects Dynamo recorded on the inputs
                placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
                assert all(a is p.meta["example_value"] for a, p in zip(args, placeholders))
            calls.append((backend.piece_signature(piece, args), _tensor_facts(args)))
            return piece.forward

        monkeypatch.setattr(backend, "_compile_with_inductor", compile_piece)
        model = build_model(source, torch.float32, "cpu", seed=1, max_positions=64)
        model.load_state_dict(eager_model.state_dict())
        cm = compiled_model(model, CompileConfig(use_compile_cache=False), "cpu",
                           max_num_tokens=64)
        eager_seqs, seqs = PagedSequences(eager_model, 2, 64), PagedSequences(model, 2, 64)
        seqs.model = _CallThrough(cm, model)
        for chunks in ({0: [1, 2, 3], 1: [4, 5]}, {0: [6], 1: [7]}):
            torch.testing.assert_close(seqs.step(chunks), eager_seqs.step(chunks),
                                       atol=1e-5, rtol=0)
        assert cm.stats.num_pieces == 4 and cm.stats.num_shared_pieces == 1
        assert cm.stats.num_dynamo_graphs == 1
    assert len(seen["traced"]) == 3
    assert seen["traced"] == seen["propagated"]


def test_split_graph_calls_attention_pieces_generated_code(compiled):
    # The bound callable is each attention piece's generated `forward`, not
    # `_LazyGraphModule._lazy_forward` (which re-enters nn.Module.__call__ per call),
    # and it runs the piece's current graph.
    _, _, cm, _, _ = compiled
    split = cm.backend.split_gm
    kinds = iter(cm.stats.piece_kinds)
    for node in split.graph.nodes:
        if node.op != "call_module" or next(kinds) != "split":
            continue
        piece = split._modules[str(node.target)]
        called = split.__dict__[str(node.target)]
        assert called.__self__ is piece
        assert called.__func__.__name__ == "forward"
        assert "unified_attention_impl" in piece.code  # the graph it was generated from
