"""The full-graph path on CPU, with the emulated CUDA graphs (capture runs the forward
once; replay re-runs it on the capture-time buffers and copies into the captured
outputs, like a real graph; inputs checked for static addresses on every replay).

Exercised through the real engine: uniform-decode steps dispatch to full graphs padded
with zero-token rows, steps with prefill tokens to piecewise graphs (or none), and
greedy tokens equal HF transformers on the same weights while requests finish and join
between replays and contexts cross KV-block boundaries. Seeded sampling gives the same
tokens in every mode. The GPU versions: tests/test_full_graphs_gpu.py.
"""

from __future__ import annotations


import numpy as np
import pytest

from llmfast import SamplingParams
from llmfast.config import CudaGraphMode
from llmfast.engine import LLMEngine
from tests.helpers.full_graphs import (
    arrival_workload,
    cuda_start_up_order,
    emulated_graph_engine,
    greedy_matches_hf,
    rope_in_the_op,
    run_with_arrivals,
)


class _ReplaySpy:
    """Records the persistent buffers every full-graph replay reads (then replays)."""

    def __init__(self, engine: LLMEngine) -> None:
        runner = engine.runner
        self.runner, self.replay = runner, runner.cuda_graphs.replay_full
        self.calls: list[dict] = []
        runner.cuda_graphs.replay_full = self

    def __call__(self, size, inputs):
        r = self.runner
        self.calls.append(dict(
            size=size, n=r.input_batch.num_reqs,
            query_start_loc=r.query_start_loc.np[: size + 1].copy(),
            seq_lens=r.seq_lens.np[:size].copy(),
            slots=r.input_batch.block_table.slot_mapping.np[:size].copy()))
        return self.replay(size, inputs)


@pytest.mark.parametrize("mode, async_scheduling", [
    (CudaGraphMode.FULL_AND_PIECEWISE, False),
    # One step in flight: the previous step's sampled ids reach the full graph's input
    # buffer on the device (placeholders), not through the host.
    (CudaGraphMode.FULL_AND_PIECEWISE, True),
    # ~20 s more; its only extra path, prefill steps compiled without graphs, is the
    # dispatch rule's (test_graph_dispatch.py) and the plain compiled mode's.
    pytest.param(CudaGraphMode.FULL_DECODE, False, marks=pytest.mark.slow),
])
def test_full_graphs_match_hf_with_joins_finishes_and_padding(ckpt, oracle, mode,
                                                             async_scheduling):
    prompts, lengths, arrivals = arrival_workload()
    engine = emulated_graph_engine(ckpt, mode)
    engine.set_async_scheduling(async_scheduling)
    compiled = engine.runner.compiled
    assert compiled.stats.full_graph_sizes == (1, 2, 4)  # sizes <= max_num_seqs 6
    piecewise_graphs = compiled.stats.num_cuda_graphs
    assert (piecewise_graphs > 0) == mode.has_piecewise
    spy = _ReplaySpy(engine)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    got = run_with_arrivals(engine, prompts, params, arrivals)
    for p, n, tokens in zip(prompts, lengths, got):
        assert tokens == oracle(p, n)
    # Full graphs ran, at padded sizes too, and their padding rows were harmless:
    # no query token (query_start_loc repeats n), seq_len 0, slot -1 (no KV write).
    assert spy.calls and {c["size"] for c in spy.calls} == {1, 2, 4}
    padded = [c for c in spy.calls if c["n"] < c["size"]]
    assert padded, "no full-graph step needed padding"
    for c in spy.calls:
        n, size = c["n"], c["size"]
        assert np.array_equal(c["query_start_loc"], np.minimum(np.arange(size + 1), n))
        assert (c["seq_lens"][n:] == 0).all() and (c["seq_lens"][:n] > 0).all()
        assert (c["slots"][n:] == -1).all() and (c["slots"][:n] >= 0).all()
    replays = compiled.graphs.piecewise.num_replays
    assert (replays > 0) == mode.has_piecewise  # steps with prefill tokens
    assert compiled.graphs.full.num_replays == len(spy.calls)
    # A tensor that is not the persistent buffer, at a captured size: caught.
    inputs = engine.runner._full_inputs(2)
    inputs[3] = inputs[3].clone()  # the block table
    with pytest.raises(AssertionError, match="full CUDA graph input moved"):
        spy.replay(2, inputs)


def test_full_graphs_with_rope_in_the_attention_op_match_hf(ckpt, oracle,
                                                           monkeypatch, tmp_path):
    # The model hands RoPE to the attention op, as on CUDA (on the CPU the op rotates
    # with the torch reference), so the step's host max_query_len is a graph input that
    # Dynamo guards: the full graphs' (made in their capture) must pass the guards the
    # steps' passed (host_max_query_len). Before it, the capture recompiled the model
    # and failed. A compile cache of its own: the first start traces, the second loads.
    rope_in_the_op(monkeypatch, tmp_path)
    # Cold (traced and saved), then warm (the saved split graph loaded: no Dynamo).
    for warm in (False, True):
        engine = emulated_graph_engine(ckpt, CudaGraphMode.FULL_AND_PIECEWISE)
        greedy_matches_hf(engine, oracle)
        compiled = engine.runner.compiled
        assert compiled.stats.precompiled == warm
        if not warm:
            assert compiled.stats.num_dynamo_graphs == 1  # one trace: every capture, step


def test_the_cuda_start_up_order_matches_hf(ckpt, oracle, monkeypatch, tmp_path):
    # What a CUDA start does, on the CPU (emulated graphs, RoPE in the op, async): the
    # memory profiled on one-block scratch caches, the real KV cache sized and bound,
    # then the model compiled and every graph captured once, on the real cache. The
    # profile's and the device's figures are stand-ins; the order is the runner's.
    calls: list[str] = []
    cuda_start_up_order(monkeypatch, calls)
    rope_in_the_op(monkeypatch, tmp_path)
    engine = emulated_graph_engine(ckpt, CudaGraphMode.FULL_AND_PIECEWISE)
    assert calls == ["profile", "size", "capture"] and engine.runner.num_blocks == 256
    compiled = engine.runner.compiled
    assert compiled.stats.full_graph_sizes == (1, 2, 4)
    graphs = engine.runner.cuda_graphs
    assert graphs is compiled.graphs and graphs._capture_stream.num_uses == 1  # once
    assert sorted(graphs.full.sizes) == [1, 2, 4]  # all of them, on the real cache
    real = engine.runner.kv_cache  # every layer's caches are views into it
    start, end = real.data_ptr(), real.data_ptr() + real.numel() * real.element_size()
    for graph in graphs.full.graphs.values():  # captured reading the real cache
        caches = graph.input_addresses[6:]  # (after ids, positions and the metadata)
        assert caches and all(start <= address < end for address in caches)
    greedy_matches_hf(engine, oracle)
    assert compiled.stats.num_dynamo_graphs == 1


@pytest.mark.slow  # ~30 s on 2 cores; the GPU suite checks the same on real graphs
def test_seeded_sampling_gives_the_same_tokens_in_every_mode(ckpt):
    prompts, lengths, arrivals = arrival_workload(seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=n, seed=100 + i,
                             ignore_eos=True) for i, n in enumerate(lengths)]
    results = {}
    for mode in (CudaGraphMode.NONE, CudaGraphMode.FULL_AND_PIECEWISE):
        results[mode] = run_with_arrivals(emulated_graph_engine(ckpt, mode), prompts, params,
                                          arrivals)
    assert results[CudaGraphMode.FULL_AND_PIECEWISE] == results[CudaGraphMode.NONE]


def _capture_rig(piecewise_sizes=None):
    """A tiny compiled model with emulated graphs and its KV cache (views of one random
    tensor, as the runner allocates it), on persistent buffers: its dummy run, its full
    forward, and a stand-in for the runner's `CaptureInputs` (dummy and full batches)."""
    from types import SimpleNamespace

    import torch

    from llmfast.attention.metadata import AttentionMetadata, host_max_query_len
    from llmfast.config import CompileConfig
    from tests.helpers.compiled import compiled_model
    from tests.test_compile import tiny_model

    model = tiny_model()
    cfg = model.config
    sizes, blocks, bs = (1, 2, 4), 9, 4
    real = torch.randn(cfg.num_hidden_layers, 2, blocks, bs, cfg.num_key_value_heads,
                       cfg.head_dim)
    model.bind_kv_caches([(layer[0], layer[1]) for layer in real])
    ids, positions = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    slots = torch.full((8,), -1, dtype=torch.int64)
    table = torch.zeros(4, 3, dtype=torch.int32)  # zeros: block 0 (the dummy runs')
    qsl, seq_lens = torch.zeros(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    cm = compiled_model(model, CompileConfig(cuda_graph_mode=CudaGraphMode.FULL_AND_PIECEWISE,
                                             cuda_graph_sizes=sizes,
                                             piecewise_graph_sizes=piecewise_sizes,
                                             check_static_addresses=True),
                        "cpu", max_num_tokens=8, max_num_reqs=4, graph_impl="emulated",
                        piece_compiler="eager")

    def dummy_batch(n: int):
        qsl[:2] = torch.tensor([0, 1], dtype=torch.int32)
        seq_lens[:1] = 1
        return ids[:n], positions[:n], AttentionMetadata(slots[:n], table[:1], qsl[:2],
                                                         seq_lens[:1])

    def run_dummy(n: int) -> None:
        with torch.inference_mode():
            cm(*dummy_batch(n))

    calls: dict[int, int] = {}

    def full_batch(size: int, dummy: bool):
        if dummy:
            ids.zero_(), positions.zero_(), slots.fill_(-1), seq_lens.fill_(1)
            qsl[: size + 1] = torch.arange(size + 1, dtype=torch.int32)
        return ids[:size], positions[:size], AttentionMetadata(
            slots[:size], table[:size], qsl[: size + 1], seq_lens[:size], host_max_query_len(1))

    def full_forward(size: int, dummy: bool):
        batch = full_batch(size, dummy)

        def fn():
            calls[size] = calls.get(size, 0) + 1
            return model.compute_logits(cm(*batch))

        caches = [t for layer in model.attention_layers() for t in (layer.k_cache,
                                                                     layer.v_cache)]
        md = batch[2]
        device_md = (md.slot_mapping, md.block_table, md.query_start_loc, md.seq_lens)
        return fn, [ids[:size], positions[:size], *device_md, *caches]

    return SimpleNamespace(cm=cm, model=model, run_dummy=run_dummy,
                           full_forward=full_forward, calls=calls, sizes=sizes,
                           capture_inputs=SimpleNamespace(dummy_batch=dummy_batch,
                                                          full_batch=full_batch),
                           ids=ids, positions=positions, slots=slots, table=table, qsl=qsl,
                           seq_lens=seq_lens)


@pytest.mark.parametrize("piecewise_sizes", [None, (2, 4)])
def test_one_capture_on_the_real_cache_warms_up_on_the_capture_stream(piecewise_sizes):
    """The capture, on CPU with emulated graphs, once the KV cache is bound: the first
    dummy run compiles, then each size, largest first, warms up and is captured, on the
    one side stream, without a recompile; replays read the real cache. With
    `piecewise_sizes` (--piecewise-graph-sizes) the piecewise graphs are captured at
    those sizes alone, the full graphs at every size."""
    import torch

    from llmfast.attention.metadata import AttentionMetadata

    rig = _capture_rig(piecewise_sizes)
    cm, model, calls, sizes = rig.cm, rig.model, rig.calls, rig.sizes
    ids, positions, slots, table, qsl, seq_lens = (
        rig.ids, rig.positions, rig.slots, rig.table, rig.qsl, rig.seq_lens)
    graphs = cm.graphs
    assert graphs.capture(rig.run_dummy, rig.full_forward) == 0  # no device memory: CPU
    assert cm.stats.full_graph_sizes == sizes and graphs._capture_stream.num_uses == 1
    assert calls == {4: 2, 2: 2, 1: 2}  # a warm-up and a capture for each full graph
    assert graphs.full.sizes == sizes
    assert cm.stats.captured_sizes == (piecewise_sizes or sizes)
    pieces = cm.stats.num_pieces
    assert cm.stats.num_cuda_graphs == pieces * len(piecewise_sizes or sizes)
    assert graphs.padded_num_tokens(1) == (piecewise_sizes or sizes)[0]  # a 1-token prefill
    assert cm.stats.one_graph
    # A decode of 3 requests padded to 4, reading real (random) cache blocks 1..8.
    ids[:4] = torch.tensor([5, 6, 7, 0])
    positions[:4] = torch.tensor([6, 2, 9, 0])
    table.copy_(torch.tensor([[3, 1, 2], [4, 0, 0], [5, 6, 7], [0, 0, 0]]))
    qsl.copy_(torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32))
    seq_lens.copy_(torch.tensor([7, 3, 10, 0], dtype=torch.int32))
    slots[:4] = -1  # nothing written: the eager forward below reads the same cache
    md = AttentionMetadata(slots[:4], table[:4], qsl, seq_lens)
    with torch.inference_mode():
        got = graphs.replay_full(4, rig.full_forward(4, False)[1])[:3].clone()
        want = model.compute_logits(model(ids[:4], positions[:4], md))[:3]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_graph_memory_estimate_counts_the_pool_and_every_graph(monkeypatch):
    """Before the KV cache is sized (on CUDA): one eager forward at the largest piecewise
    size and one whole forward with logits at the largest full size, their peaks added
    (the pool), plus GRAPH_OBJECT_BYTES for every graph: pieces (attention layers + 1)
    x piecewise sizes, plus the full sizes. The device's peaks are stood in for (the
    tokens each forward ran x 1 MiB, its logits' rows x 10 MiB)."""
    import torch

    from llmfast.worker.startup import graph_memory

    MiB = 2**20
    rig = _capture_rig((2, 4))
    runs = []

    def peak(forward, device):
        out = forward()
        runs.append(tuple(out.shape))
        return out.shape[0] * (10 * MiB if out.shape[-1] == rig.model.config.vocab_size
                               else MiB)

    monkeypatch.setattr(graph_memory, "_peak_bytes", peak)
    layers = len(rig.model.attention_layers())
    hidden, vocab = rig.model.config.hidden_size, rig.model.config.vocab_size
    cuda = torch.device("cuda")
    got = graph_memory.estimate_graph_memory(rig.model, rig.capture_inputs, rig.cm.graphs,
                                             cuda)
    assert runs == [(4, hidden), (4, vocab)]  # largest piecewise (4), largest full (4)
    graphs = (layers + 1) * 2 + 3  # 2 piecewise sizes, 3 full
    assert got == 4 * MiB + 40 * MiB + graphs * graph_memory.GRAPH_OBJECT_BYTES
    # Off CUDA (the emulated graphs take no device memory) and without graphs: none.
    assert graph_memory.estimate_graph_memory(rig.model, rig.capture_inputs,
                                              rig.cm.graphs, torch.device("cpu")) == 0


# The child: this module's engine (on random:tiny) and workload, the eager synchronous
# loop against full graphs under async scheduling.
_INTERPRETED_FULL_GRAPHS_CHILD = """
import json
from llmfast import SamplingParams
from llmfast.config import CudaGraphMode
from tests.helpers.full_graphs import arrival_workload, emulated_graph_engine, run_with_arrivals

prompts, lengths, arrivals = arrival_workload()
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
full = emulated_graph_engine("random:tiny", CudaGraphMode.FULL_AND_PIECEWISE)
full.set_async_scheduling(True)
eager = emulated_graph_engine("random:tiny", None)
result = {"eager_sync": run_with_arrivals(eager, prompts, params, arrivals),
          "full_async": run_with_arrivals(full, prompts, params, arrivals)}
print(json.dumps(dict(result, full_replays=full.runner.compiled.graphs.full.num_replays)))
"""


@pytest.mark.slow
def test_full_graphs_with_triton_attention_under_async_scheduling():
    """The CUDA default's path as far as a CPU goes (~60 s): compiled pieces, emulated
    full and piecewise graphs, async scheduling, and the attention op's Triton kernels in
    the interpreter (the layers' norm and RoPE kernels off: Dynamo cannot trace their
    interpreted launches), against the eager synchronous loop: the same greedy tokens."""
    from tests.helpers.interpreted import run_interpreted

    result = run_interpreted(_INTERPRETED_FULL_GRAPHS_CHILD, timeout_s=900,
                             LLMFAST_LAYER_KERNELS="0")
    assert result["full_replays"] > 0
    assert result["full_async"] == result["eager_sync"]


@pytest.mark.slow
def test_full_graphs_with_rope_in_the_attention_op_under_async_scheduling(tmp_path):
    """The same (~60 s), with RoPE inside the attention op as on CUDA (the layer kernels
    stay off for Dynamo, so the model is told the op rotates): uniform decode steps take
    the fused decode + RoPE kernel, in the full graphs too, and mixed steps rotate in
    the KV write. Greedy tokens equal the eager synchronous loop's with the torch RoPE
    before the op, and with the op rotating. A compile cache of its own: the start traces
    (a warm one would load the graph, the patched model's fingerprint being the same).
    It failed so before host_max_query_len: the full graphs' max_query_len, made in their
    capture, recompiled the model mid-capture."""
    from tests.helpers.interpreted import run_interpreted

    result = run_interpreted(_INTERPRETED_ROPE_IN_OP_CHILD, timeout_s=900,
                             LLMFAST_LAYER_KERNELS="0", LLMFAST_CACHE=str(tmp_path))
    assert result["full_replays"] > 0 and result["fused_decode_plans"] > 0
    assert result["full_async"] == result["eager_sync_rope_in_op"] == result["eager_sync"]


# The child: as above, the model told that its attention op rotates q and k (what
# rope_fuses_into_attention answers on CUDA) once the torch-RoPE oracle has run.
_INTERPRETED_ROPE_IN_OP_CHILD = """
import json
from llmfast import SamplingParams
from llmfast.config import CudaGraphMode
from llmfast.attention.triton import launch as attention
from llmfast.kernels.layers.rotary_reference import rope_cache_takes
from llmfast.models import decoder
from tests.helpers.full_graphs import arrival_workload, emulated_graph_engine, run_with_arrivals

prompts, lengths, arrivals = arrival_workload()
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
result = {"eager_sync": run_with_arrivals(emulated_graph_engine("random:tiny", None), prompts,
                                          params, arrivals)}
decoder.rope_fuses_into_attention = rope_cache_takes
result["eager_sync_rope_in_op"] = run_with_arrivals(emulated_graph_engine("random:tiny", None),
                                                    prompts, params, arrivals)
full = emulated_graph_engine("random:tiny", CudaGraphMode.FULL_AND_PIECEWISE)
full.set_async_scheduling(True)
result["full_async"] = run_with_arrivals(full, prompts, params, arrivals)
result["fused_decode_plans"] = sum(plan.rope for plan in attention._PLANS.values())
print(json.dumps(dict(result, full_replays=full.runner.compiled.graphs.full.num_replays)))
"""

