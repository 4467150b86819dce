"""Structured outputs through llguidance: grammar text of a StructuredOutputs, and the matchers
of a rank's constrained requests with the token masks they allow.

Where it lives: the rank that samples (the driver). The grammar travels once, inside the
request's SamplingParams; each step the matchers advance by the tokens the requests accepted and
fill one bitmask row per constrained request, so masks never cross the per-step wire (invariant
5) and, with one sampler, TP ranks cannot disagree. n > 1 samples are requests of their own,
each with its own matcher.

Masks: the step's rows are known before its forward, so their masks are filled on a thread of
their own (llguidance's threads, off the GIL) and unpacked into an additive row of 0 / -inf
while the forward runs; the sampler adds them, and waits only if the forward finished first.

Compiling: a grammar is compiled once per rank (`LLMatcher` over the model's tokenizer), on a
worker thread as soon as its request arrives, while that step's forward runs; later requests
with the same grammar take a copy of the compiled template (microseconds). The tokenizer view
llguidance needs is built on the first constrained request (about a second, once).

Why llguidance: it installs as one small wheel with no dependency (xgrammar pulls triton, and
with it GPU tooling), its grammars need no per-vocabulary precompute, and it computes masks
for a batch on its own threads, off the GIL.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from tierserve.scheduler.output_rules import StructuredOutputs
from tierserve.workers.grammar import grammar_of, llguidance_module

__all__ = ["GrammarMatchers", "mask_bias"]


def mask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask int32[r, ceil(vocab / 32)] (bit b of word w allows token 32 w + b) as what to
    add to the logits: float32[r, vocab], 0 where allowed, -inf elsewhere."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab_size].view(np.bool_))
    return torch.zeros(allowed.shape).masked_fill_(allowed.logical_not_(), -float("inf"))


class GrammarMatchers:
    """Constrained requests' matchers on one rank, by request id."""

    def __init__(self, tokenizer_file: str | None, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._tokenizer: Future | None = None
        self._templates: dict[str, Future] = {}  # grammar -> compiled template matcher
        self._pending: dict[str, Future] = {}    # request id -> its template, compiling
        self._matchers: dict = {}                # request id -> its own matcher
        self._executor = None
        # This step's masks, filled on a thread of their own while the forward runs.
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._prefetched: tuple[tuple[str, ...], Future] | None = None

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._matchers or req_id in self._pending

    def __len__(self) -> int:
        """Nonzero while any request is constrained or a fill is in flight."""
        return len(self._matchers) + len(self._pending) + (self._prefetched is not None)

    def add(self, req_id: str, spec: StructuredOutputs) -> None:
        """Starts compiling the request's grammar (or reuses the compiled one)."""
        grammar = grammar_of(spec)
        template = self._templates.get(grammar)
        if template is None:
            template = self._templates[grammar] = self._pool.submit(self._compile, grammar)
        self._pending[req_id] = template

    def _load_tokenizer(self):
        llg = llguidance_module()
        if self.tokenizer_file is None:
            raise ValueError("structured outputs need the model's tokenizer.json on the rank "
                             "that samples")
        with open(self.tokenizer_file, encoding="utf-8") as f:
            text = f.read()
        return llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)

    def _compile(self, grammar: str):
        if self._tokenizer is None:
            self._tokenizer = Future()
            try:
                self._tokenizer.set_result(self._load_tokenizer())
            except BaseException as e:
                self._tokenizer.set_exception(e)
        matcher = llguidance_module().LLMatcher(self._tokenizer.result(), grammar)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be compiled: {matcher.get_error()}")
        return matcher

    def _matcher(self, req_id: str):
        m = self._matchers.get(req_id)
        if m is None:  # in _pending until in _matchers: `in` and len() never miss it
            m = self._matchers[req_id] = self._pending[req_id].result().deep_copy()
            del self._pending[req_id]
        return m

    def remove(self, req_id: str) -> None:
        if self._prefetched is not None and req_id in self._prefetched[0]:
            self._prefetched[1].result()
            self._prefetched = None
        self._pending.pop(req_id, None)
        self._matchers.pop(req_id, None)

    def advance(self, req_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """The tokens the requests accepted (token_ids[i] is req_ids[i]'s); others ignored."""
        if self._prefetched is not None:  # a fill in flight reads the matchers
            self._prefetched[1].result()
            self._prefetched = None
        for rid, token in zip(req_ids, token_ids):
            if rid in self._matchers or rid in self._pending:
                self._matcher(rid).consume_token(int(token))

    def prefetch(self, req_ids: Sequence[str]) -> None:
        """Starts filling this step's masks (the rows about to sample), so that they are
        ready when the forward is; every matcher has seen its accepted tokens by now."""
        key = tuple(req_ids)
        self._prefetched = (key, self._mask_pool.submit(self._fill, key))

    def masks(self, req_ids: Sequence[str]) -> tuple[list[int], torch.Tensor] | None:
        """(rows of req_ids that are constrained, what to add to their logits: float32[
        len(rows), vocab], 0 or -inf) for this step, or None when no row is."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            if prefetched[0] == tuple(req_ids):
                return prefetched[1].result()
            prefetched[1].result()  # never two fills at once
        return self._fill(req_ids)

    def _fill(self, req_ids: Sequence[str]) -> tuple[list[int], torch.Tensor] | None:
        rows = [i for i, rid in enumerate(req_ids) if rid in self]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        matchers = [(self._matcher(req_ids[i]), j) for j, i in enumerate(rows)]
        if self._executor is None:
            self._executor = llguidance_module().LLExecutor()
        # llguidance's own threads fill the rows, without the GIL.
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4,
                                               len(rows))
        return rows, mask_bias(bitmask, self.vocab_size)
