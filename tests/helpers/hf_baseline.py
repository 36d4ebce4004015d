"""The HF baseline's weight mapping (`bench --baseline hf`, llmfast/bench/hf.py) checked on
one prompt: a random llmfast model of a config, its weights perturbed so that norms and
biases show, copied into HF's model of the family; both compute the prompt's logits."""

from __future__ import annotations


def assert_hf_baseline_logits(config, prompt: list[int], perturb) -> None:
    """`perturb(name, parameter)` changes each llmfast parameter in place (under no_grad)
    before HF's model is made from them; the prefill logits must agree to 1e-4."""
    import torch

    from llmfast.bench.hf import hf_model_from_llmfast
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import ModelSource
    from tests.helpers.paged import PagedSequences

    ours = build_model(ModelSource("random:test", None, config), torch.float32, "cpu", seed=3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            perturb(name, p)
    hf = hf_model_from_llmfast(ours, config).eval()
    got = PagedSequences(ours, num_seqs=1, max_len=32).step({0: prompt})
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
