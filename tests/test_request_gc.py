"""What a request leaves for the cyclic garbage collector to walk.

A full collection walks every tracked object and, in a list, every element: a waiting
request's prompt held in lists made every full collection of a server with many queued
requests cost time in proportion to their prompts (core/request.py's module doc). These
check the representation that avoids it, and that the public outputs keep their types.
"""

from __future__ import annotations

import gc
from array import array

import pytest

from llmfast import LLM, SamplingParams
from llmfast.core.request import Request


def _walked_elements(obj) -> int:
    """How many references a collection visits in `obj` itself (0 when untracked)."""
    if not gc.is_tracked(obj):
        return 0
    return len(gc.get_referents(obj))


def test_a_waiting_requests_prompt_is_not_walked_by_the_collector():
    prompt = list(range(3, 1003))
    request = Request("r", prompt, SamplingParams(max_tokens=4), eos_token_ids=(2,))
    gc.collect()  # CPython stops tracking a tuple of ints at the first collection
    # The request's own references: none of them holds the prompt's 1000 elements.
    walked = sum(_walked_elements(o) for o in gc.get_referents(request))
    assert walked < 50, walked
    assert request.prompt_token_ids == tuple(prompt)
    assert not gc.is_tracked(request.prompt_token_ids)
    assert isinstance(request.all_token_ids, array)
    assert list(request.all_token_ids) == prompt


def test_all_token_ids_grows_with_the_outputs():
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=4))
    request.append_output_token_ids([8, 9])
    assert list(request.all_token_ids) == [5, 6, 7, 8, 9]
    assert request.output_token_ids == [8, 9]
    assert request.num_tokens == 5 and request.num_prompt_tokens == 3
    assert request.prompt_token_ids == (5, 6, 7)


def test_requests_with_the_same_stop_tokens_share_one_set():
    params = SamplingParams(max_tokens=4, stop_token_ids=[11])
    a = Request("a", [1], params, eos_token_ids=(2,))
    b = Request("b", [1], SamplingParams(max_tokens=9, stop_token_ids=[11]),
                eos_token_ids=(2,))
    assert a.stop_token_set == {2, 11} and a.stop_token_set is b.stop_token_set
    ignoring = Request("c", [1], SamplingParams(max_tokens=4, stop_token_ids=[11],
                                                ignore_eos=True), eos_token_ids=(2,))
    assert ignoring.stop_token_set == {11}


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", device="cpu", dtype="float32", enforce_eager=True)


def test_outputs_give_the_prompt_as_a_list_made_once(llm):
    prompt = [5, 6, 7, 8]
    outs = list(llm.stream({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=4, ignore_eos=True)))
    assert len(outs) >= 2
    assert all(type(o.prompt_token_ids) is list and o.prompt_token_ids == prompt
               for o in outs)
    # One list for the whole stream, not a copy per step.
    assert len({id(o.prompt_token_ids) for o in outs}) == 1
    final = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert type(final.prompt_token_ids) is list and final.prompt_token_ids == prompt
