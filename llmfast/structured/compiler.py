"""Grammars compiled against the model's vocabulary, off the step's path, cached.

`GrammarCache.submit(spec)` returns at once with a future: a worker thread builds the
vocabulary's token table (once: ~0.4 s for a 49k-token BPE) and compiles the grammar
(tens of ms for a nested JSON schema, see profiles/structured.md); the step that first
samples the request takes the result. Compiled grammars are kept by `spec.key`, so a
schema every request repeats compiles once; the oldest are dropped past `max_entries`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from llmfast.structured.grammars import build_grammar
from llmfast.structured_params import StructuredOutputs

if TYPE_CHECKING:  # xgrammar imports transformers: loaded at the first constraint only
    import xgrammar as xgr

logger = logging.getLogger(__name__)


def tokenizer_info(hf_tokenizer: Any, vocab_size: int,
                   stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary. `vocab_size` is the model's (its logits' width,
    maybe padded past the tokenizer's tokens: those are never allowed). A tokenizer
    transformers does not know (the random presets' byte-level one) is read as its
    decoded tokens."""
    import xgrammar as xgr
    stops = list(stop_token_ids) or None
    try:
        return xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stops)
    except Exception:  # noqa: BLE001 - not a transformers tokenizer: read its tokens
        n = len(hf_tokenizer)
        vocab = [hf_tokenizer.decode([i]) for i in range(n)]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=stops)


class GrammarCache:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 stop_token_ids: tuple[int, ...], max_entries: int = 256) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.max_entries = max_entries
        self._compiler: xgr.GrammarCompiler | None = None
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmfast-grammar")

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of the CompiledGrammar of `spec` (an exception if it does not compile)."""
        key = spec.key
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._entries[key] = future
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        import xgrammar as xgr
        if self._compiler is None:
            info = tokenizer_info(self._load_tokenizer(), self.vocab_size, self.stop_token_ids)
            # xgrammar's own cache off: this one keys by the spec.
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler.compile_grammar(build_grammar(spec))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
