"""Draft-model proposer on tiny random Llama checkpoints, driven by a small synchronous
verify loop over paged KV caches (the target's and the draft's share block ids): with
the target's own weights as the draft, greedy drafts are all accepted and the output is
plain greedy decoding; with another draft the output is still plain greedy decoding;
sampled drafts from the target's own weights are (nearly) all accepted too. Chunked
prefill, a late request and a row near max_model_len are in the mix."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmfast.attention.metadata import AttentionMetadata
from llmfast.config import CacheConfig
from llmfast.attention.workspaces import AttentionWorkspaces
from llmfast.models.loading.load_error import LoadError
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import resolve_model
from llmfast.sampling_params import SamplingParams
from llmfast.worker.spec_decode.draft_proposer import DraftModelProposer
from llmfast.worker.spec_decode.proposer import ProposalInputs, StepTensors
from llmfast.worker.spec_decode.rejection_sampler import rejection_sample
from llmfast.worker.startup.kv_cache_sizing import kv_block_bytes, num_cpu_blocks
from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.sampling import metadata_from_params

BLOCK, NUM_BLOCKS, MAX_LEN, K = 4, 64, 48, 3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("draft")
    target = make_hf_checkpoint(base / "target", seed=0)
    # The target's weights plus small noise: a draft that agrees on some argmaxes (a
    # random tiny model's distributions are flat; this noise level accepts ~half).
    perturbed = base / "perturbed"
    shutil.copytree(target, perturbed)
    weights = load_file(perturbed / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file({k: v + 0.005 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              perturbed / "model.safetensors", metadata={"format": "pt"})
    return {"target": target, "perturbed": perturbed,
            # Another shape: one layer (its own KV layout in the shared blocks).
            "small": make_hf_checkpoint(base / "small", seed=1, num_hidden_layers=1),
            "vocab": make_hf_checkpoint(base / "vocab", seed=2, vocab_size=128)}


class VerifyLoop:
    """The runner's verify path, plainly: one target step per call over every live
    request (prompt chunks of at most `chunk` tokens, or the last token plus its drafts),
    rejection sampling, then the proposer's drafts for the next step."""

    def __init__(self, target_path, proposer: DraftModelProposer | None,
                 params: list[SamplingParams], chunk: int = 8, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.model = build_model(resolve_model(str(target_path)), torch.float32, self.device,
                                 max_positions=MAX_LEN)
        cfg = self.model.rank_config
        self.cache = torch.zeros(cfg.num_hidden_layers, 2, NUM_BLOCKS, BLOCK,
                                 cfg.num_key_value_heads, cfg.head_dim, device=self.device)
        self.model.bind_kv_caches([(c[0], c[1]) for c in self.cache])
        self.workspaces = AttentionWorkspaces([self.cache])
        self.proposer = proposer
        if proposer is not None:
            proposer.initialize(NUM_BLOCKS, BLOCK)
        self.params, self.chunk = params, chunk
        n = len(params)
        # Shuffled, disjoint blocks per request (block 0 is the null block).
        blocks = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(0)) + 1
        per = MAX_LEN // BLOCK
        self.block_table = blocks[:n * per].view(n, per).to(torch.int32)
        self.token_ids = np.zeros((n, MAX_LEN), dtype=np.int32)
        self.num_tokens = np.zeros(n, dtype=np.int32)
        self.num_prompt = np.zeros(n, dtype=np.int32)
        self.num_computed = np.zeros(n, dtype=np.int32)
        self.max_tokens = np.zeros(n, dtype=np.int32)
        self.drafts: list[list[int]] = [[] for _ in range(n)]
        self.probs: dict[int, torch.Tensor] = {}  # request -> [K, vocab] of its drafts
        self.proposed = self.accepted = 0

    def add(self, row: int, prompt: list[int], max_tokens: int) -> None:
        self.token_ids[row, :len(prompt)] = prompt
        self.num_tokens[row] = self.num_prompt[row] = len(prompt)
        self.max_tokens[row] = max_tokens

    def outputs(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt[row]:self.num_tokens[row]].tolist()

    def live(self) -> list[int]:
        return [r for r in range(len(self.params)) if self.num_prompt[r] and
                self.num_tokens[r] - self.num_prompt[r] < self.max_tokens[r]]

    def step(self) -> None:
        rows = self.live()
        ids, pos, slots, qsl, seq_lens, sample_rows, drafts = [], [], [], [0], [], [], []
        for r in rows:
            c = int(self.num_computed[r])
            known = self.token_ids[r, c:min(self.num_tokens[r], c + self.chunk)].tolist()
            query = known + self.drafts[r]
            for j, t in enumerate(query):
                p = c + j
                ids.append(t)
                pos.append(p)
                slots.append(int(self.block_table[r, p // BLOCK]) * BLOCK + p % BLOCK)
            qsl.append(qsl[-1] + len(query))
            seq_lens.append(c + len(query))
            if c + len(known) == self.num_tokens[r]:  # the prompt is done: it samples
                sample_rows.append(len(qsl) - 2)
                drafts.append(self.drafts[r])
        dev = self.device
        block_table = self.block_table[rows].to(dev)
        md = AttentionMetadata(torch.tensor(slots, device=dev), block_table,
                               torch.tensor(qsl, dtype=torch.int32, device=dev),
                               torch.tensor(seq_lens, dtype=torch.int32, device=dev))
        input_ids, positions = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, md)
            # Per sampling row: its draft positions then its last position.
            logit_rows = [qsl[i + 1] - 1 - len(d) + j for i, d in zip(sample_rows, drafts)
                          for j in range(len(d) + 1)]
            logits = self.model.compute_logits(hidden[logit_rows])
        params = [self.params[rows[i]] for i in sample_rows]
        steps = [int(self.num_tokens[rows[i]] - self.num_prompt[rows[i]]) for i in sample_rows]
        sampling = metadata_from_params(params, vocab_size=logits.shape[-1], steps=steps,
                                        device=dev)
        flat = [t for d in drafts for t in d]
        cu = torch.tensor([0, *np.cumsum([len(d) for d in drafts]).tolist()], dtype=torch.int32,
                          device=dev)
        res = rejection_sample(logits, torch.tensor(flat, dtype=torch.int64, device=dev), cu,
                               self.draft_probs([rows[i] for i in sample_rows], drafts),
                               sampling,
                               max_num_draft_tokens=K)
        n = len(rows)
        output_token_ids = torch.full((n, K + 1), -1, dtype=torch.int64, device=dev)
        num_emitted = torch.zeros(n, dtype=torch.int32, device=dev)
        output_token_ids[sample_rows] = res.output_token_ids
        num_emitted[sample_rows] = res.num_emitted.to(torch.int32)
        out_host, emitted_host = output_token_ids.cpu(), num_emitted.tolist()
        for i, r in enumerate(rows):
            c, e = int(self.num_computed[r]), emitted_host[i]
            if e == 0:  # a prompt chunk
                self.num_computed[r] = c + qsl[i + 1] - qsl[i]
                continue
            self.proposed += len(self.drafts[r])
            self.accepted += e - 1
            room = min(e, self.max_tokens[r] - (self.num_tokens[r] - self.num_prompt[r]))
            self.token_ids[r, self.num_tokens[r]:self.num_tokens[r] + room] = \
                out_host[i, :room].numpy()
            self.num_tokens[r] += room
            self.num_computed[r] = self.num_tokens[r] - 1
        self.propose(rows, sample_rows, StepTensors(
            input_ids, positions, md.slot_mapping, md.query_start_loc, md.seq_lens,
            block_table, output_token_ids, num_emitted), sampling)

    def draft_probs(self, reqs, drafts):
        """The distributions the drafts were drawn from, flat in the drafts' order."""
        if not self.probs or not any(drafts):
            return None
        return torch.cat([self.probs[r][:len(d)] for r, d in zip(reqs, drafts) if d])

    def propose(self, rows, sample_rows, step: StepTensors, sampling) -> None:
        for r in range(len(self.params)):
            self.drafts[r] = []
        if self.proposer is None:
            return
        max_drafts = np.zeros(len(rows), dtype=np.int32)
        for i in sample_rows:
            r = rows[i]
            left = self.max_tokens[r] - (self.num_tokens[r] - self.num_prompt[r])
            max_drafts[i] = max(0, min(K, MAX_LEN - 1 - self.num_tokens[r], left - 1))
        # The per-row metadata of the rows in step order (rows that only ran a chunk
        # draw nothing: any params do).
        full = metadata_from_params([self.params[r] for r in rows], vocab_size=256,
                                    device=self.device)
        out = self.proposer.propose(ProposalInputs(
            req_ids=[str(r) for r in rows], token_ids=self.token_ids[rows],
            num_tokens=self.num_tokens[rows], max_num_drafts=max_drafts, step=step),
            sampling=None if sampling.all_greedy else full)
        assert (out.num_drafts <= max_drafts).all()
        for i, r in enumerate(rows):
            self.drafts[r] = out.token_ids[i, :out.num_drafts[i]].tolist()
        self.probs = {} if out.probs is None else {r: out.probs[i] for i, r in enumerate(rows)}

    def run(self, prompts: dict[int, list[int]], max_tokens: int, late: dict | None = None):
        for r, p in prompts.items():
            self.add(r, p, max_tokens)
        steps = 0
        while self.live() or late:
            self.step()
            steps += 1
            if late and steps == 2:  # a request arrives while the others decode
                for r, p in late.items():
                    self.add(r, p, max_tokens)
                late = None
        return {r: self.outputs(r) for r in range(len(self.params))}


PROMPTS = {0: [5, 17, 99, 3, 42, 8, 250, 61, 7, 7, 19], 1: [200, 1, 64], 2: list(range(30, 50))}
LATE = {3: [9, 8, 7, 6, 5, 4]}


def plain(ckpts, params, max_tokens, device="cpu"):
    return VerifyLoop(ckpts["target"], None, params, device=device).run(
        PROMPTS, max_tokens, dict(LATE))


def proposer_for(path, device="cpu"):
    return DraftModelProposer(K, resolve_model(str(path)), target_vocab_size=256,
                              dtype=torch.float32, device=device, max_model_len=MAX_LEN)


@pytest.mark.parametrize("draft", ["target", "perturbed", "small"])
def test_greedy_output_equals_plain_decoding(ckpts, draft):
    params = [SamplingParams(temperature=0.0)] * 4
    want = plain(ckpts, params, max_tokens=14)
    loop = VerifyLoop(ckpts["target"], proposer_for(ckpts[draft]), params)
    got = loop.run(PROMPTS, 14, dict(LATE))
    assert got == want
    assert all(len(v) == 14 for v in got.values())
    assert loop.proposed > 20
    if draft == "target":
        assert loop.accepted == loop.proposed  # the same weights agree on every argmax
    elif draft == "perturbed":
        assert 0 < loop.accepted < loop.proposed  # both the accept and reject paths ran
    else:
        assert loop.accepted < loop.proposed


def test_sampled_drafts_from_the_target_weights_are_accepted(ckpts):
    """q = p (to rounding) for every random row: the accept test u * q < p passes for
    nearly every u, so the sampled path's probabilities and tokens must line up."""
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(3)] + [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9)]
    loop = VerifyLoop(ckpts["target"], proposer_for(ckpts["target"]), params)
    got = loop.run(PROMPTS, 12, dict(LATE))
    assert all(len(v) == 12 for v in got.values())
    assert loop.proposed > 20 and loop.accepted >= 0.95 * loop.proposed
    # Seeded requests are reproducible (the unseeded one draws from the global generator).
    again = VerifyLoop(ckpts["target"], proposer_for(ckpts["target"]), params).run(
        PROMPTS, 12, dict(LATE))
    assert all(got[r] == again[r] for r in range(3))


def test_rows_near_max_model_len_get_fewer_drafts(ckpts):
    params = [SamplingParams(temperature=0.0)]
    long = {0: list(range(10, 10 + MAX_LEN - 6))}
    want = VerifyLoop(ckpts["target"], None, params, chunk=64).run(long, 5)
    loop = VerifyLoop(ckpts["target"], proposer_for(ckpts["target"]), params, chunk=64)
    assert loop.run(long, 5) == want


def test_vocab_mismatch_and_block_bytes(ckpts):
    with pytest.raises(LoadError, match="vocabulary of 128 tokens, the target's has 256"):
        proposer_for(ckpts["vocab"])
    proposer = proposer_for(ckpts["small"])
    cfg = dataclasses.replace(proposer.model.rank_config)
    assert proposer.kv_block_bytes(BLOCK) == kv_block_bytes(cfg, BLOCK, torch.float32)
    assert proposer.kv_block_bytes(BLOCK) == 2 * 1 * cfg.kv_size * 4 * BLOCK  # 1 layer
    assert proposer.num_lookahead_slots == K
    # The cache sizing counts both caches in every block.
    target = build_model(resolve_model(str(ckpts["target"])), torch.float32, "cpu",
                         max_positions=MAX_LEN).rank_config
    cache = CacheConfig(block_size=BLOCK, kv_cache_memory=1 << 20)
    both = kv_block_bytes(target, BLOCK, torch.float32) + proposer.kv_block_bytes(BLOCK)
    assert num_cpu_blocks(cache, target, torch.float32,
                          extra_block_bytes=proposer.kv_block_bytes(BLOCK)) == (1 << 20) // both
    assert num_cpu_blocks(cache, target, torch.float32) == \
        (1 << 20) // kv_block_bytes(target, BLOCK, torch.float32)


@pytest.mark.gpu
def test_cuda_greedy_and_sampled_drafts(ckpts):
    """The same loop on a GPU: greedy output equals plain decoding with a different
    draft, the target's own weights are accepted in full, sampled drafts nearly so."""
    greedy = [SamplingParams(temperature=0.0)] * 4
    want = plain(ckpts, greedy, 12, device="cuda")
    for draft in ("target", "perturbed"):
        loop = VerifyLoop(ckpts["target"], proposer_for(ckpts[draft], "cuda"), greedy,
                          device="cuda")
        assert loop.run(PROMPTS, 12, dict(LATE)) == want
        assert draft != "target" or loop.accepted == loop.proposed
    sampled = [SamplingParams(temperature=0.9, seed=s) for s in range(4)]
    loop = VerifyLoop(ckpts["target"], proposer_for(ckpts["target"], "cuda"), sampled,
                      device="cuda")
    loop.run(PROMPTS, 12, dict(LATE))
    assert loop.accepted >= 0.95 * loop.proposed > 0
