"""Persistent per-request sampling state the worker keeps across steps: seeded generators
(made, skipped ahead, rewound), penalty count / prompt-mask tables, token rules and grammar
matchers, from which each step's SamplingBatch is built.

Reproducibility: a seeded request owns a torch.Generator and each step it is sampled draws exactly
`vocab` uniforms from it, so its tokens do not depend on batch size or its row position.
The caller must only include rows whose token it keeps (not partial-prefill chunks), otherwise the
generator advances on a discarded draw. Unseeded rows share one generator.

Penalty requests own a slot holding an output-token count row and a prompt-token mask row; each
step adds one count per request in a single batched scatter, so penalties cost O(batch x vocab)
device work per step and O(batch) Python work, independent of context length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tierserve.scheduler.params import SamplingParams
from tierserve.workers.sampling_batch import (
    PenaltyInputs,
    SamplingBatch,
    fill_penalty_row,
    has_penalties,
    is_greedy,
)
from tierserve.workers.structured import GrammarMatchers
from tierserve.workers.token_rules import TokenRules

__all__ = ["SamplingStateTable", "make_generator", "skip_draws"]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's private generator when it has a seed; None means "use the shared one"."""
    if seed is None:
        return None
    # SamplingParams bounds seeds to [0, 2**64), which is what manual_seed takes.
    return torch.Generator(device=device).manual_seed(seed)


def skip_draws(generator: torch.Generator, num_tokens: int, vocab_size: int,
               device: torch.device | str) -> None:
    """Advances a seeded generator past the draws of num_tokens sampled tokens: the same calls
    the sampler made (one row of vocab_size uniforms per token), so the state is the same on
    every device. O(num_tokens x vocab) once, when a request moves to new workers."""
    row = torch.empty(vocab_size, dtype=torch.float32, device=device)
    for _ in range(num_tokens):
        row.uniform_(generator=generator)


@dataclass
class _TableEntry:
    params: SamplingParams
    generator: torch.Generator | None
    slot: int  # row in the penalty tables, -1 when the request has no penalties
    rules: TokenRules | None = None


class SamplingStateTable:
    """Per-request sampling state the worker keeps across steps.

    Only requests with penalties take a slot in the count / mask tables; the tables grow by
    doubling, so memory is O(penalised requests x vocab).
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 initial_capacity: int = 8, grammars: GrammarMatchers | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._ruled = 0  # entries with token rules
        # Matchers of constrained requests (structured outputs); None off the sampling rank.
        self.grammars = grammars
        self.device = torch.device(device)
        self._entries: dict[str, _TableEntry] = {}
        self._counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self._prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._free_slots: list[int] = []
        self._grow(max(1, initial_capacity))

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int] = (),
                    generator: torch.Generator | None = None) -> None:
        """Register a request (O(context) once). `generator` resumes a saved seeded generator
        (e.g. one returned by remove_request at preemption); otherwise one is made from the
        seed, past the draws that sampled output_token_ids (a request that other workers
        started), so that its random stream continues where theirs stopped."""
        if req_id in self._entries:
            raise ValueError(f"request {req_id!r} already has sampling state")
        if generator is None:
            generator = make_generator(params.seed, self.device)
            if generator is not None and len(output_token_ids):
                skip_draws(generator, len(output_token_ids), self.vocab_size, self.device)
        slot = -1
        if has_penalties(params):
            slot = self._take_slot()
            fill_penalty_row(self._counts[slot], self._prompt_mask[slot], prompt_token_ids,
                             output_token_ids)
        # Only the rank that samples (the one with matchers) follows the grammar.
        if params.structured_outputs is not None and self.grammars is not None:
            self.grammars.add(req_id, params.structured_outputs)
            if len(output_token_ids):
                self.grammars.advance([req_id] * len(output_token_ids), list(output_token_ids))
        rules = None
        if TokenRules.needed(params):
            rules = TokenRules(params, self.vocab_size, self.eos_token_ids, self.device)
            for token in output_token_ids:
                rules.push(int(token))
            self._ruled += 1
        self._entries[req_id] = _TableEntry(params, generator, slot, rules)

    def remove_request(self, req_id: str) -> torch.Generator | None:
        """Drop a request's state; returns its seeded generator so a preempted request can resume
        its random stream."""
        entry = self._entries.pop(req_id)
        if entry.rules is not None:
            self._ruled -= 1
        if self.grammars is not None:
            self.grammars.remove(req_id)
        if entry.slot >= 0:
            self._free_slots.append(entry.slot)
        return entry.generator

    def append_tokens(self, req_ids: Sequence[str],
                      token_ids: torch.Tensor | Sequence[int]) -> None:
        """Count tokens the requests accepted this step: token_ids[i] belongs to req_ids[i].

        token_ids may be the sampler's device tensor (no host sync unless a request is
        constrained). A request may appear more than once (several tokens in a step); counts
        accumulate.
        """
        if self._ruled or (self.grammars is not None and len(self.grammars)):
            self._follow(req_ids, token_ids)
        positions, slots = [], []
        for i, req_id in enumerate(req_ids):
            slot = self._entries[req_id].slot
            if slot >= 0:
                positions.append(i)
                slots.append(slot)
        if not slots:
            return
        tokens = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if len(positions) != len(req_ids):
            tokens = tokens[torch.tensor(positions, dtype=torch.long, device=self.device)]
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._counts.index_put_((slot_t, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                accumulate=True)

    def _follow(self, req_ids: Sequence[str], token_ids) -> None:
        """Constrained and ruled requests see their accepted tokens (a host sync, for them)."""
        listed = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if self.grammars is not None and len(self.grammars):
            self.grammars.advance(req_ids, listed)
        if self._ruled:
            for rid, token in zip(req_ids, listed):
                rules = self._entries[rid].rules
                if rules is not None:
                    rules.push(int(token))

    def _adjust(self, entries: list[_TableEntry]) -> tuple[list[int], torch.Tensor] | None:
        rows, dense = [], []
        for i, e in enumerate(entries):
            row = e.rules.row() if e.rules is not None else None
            if row is not None:
                rows.append(i)
                dense.append(row)
        return (rows, torch.stack(dense)) if rows else None

    def prefetch(self, req_ids: Sequence[str]) -> None:
        """The rows that will sample this step, before its forward: constrained ones start
        filling their masks."""
        if self.grammars is not None and len(self.grammars):
            self.grammars.prefetch(req_ids)

    def seeded_states(self, req_ids: Sequence[str]) -> dict[str, torch.Tensor]:
        """The generator state of each seeded random request of req_ids, before a step draws."""
        return {r: e.generator.get_state() for r in dict.fromkeys(req_ids)
                if (e := self._entries[r]).generator is not None and not is_greedy(e.params)}

    def rewind(self, req_id: str, state: torch.Tensor, num_tokens: int) -> None:
        """Sets a request's generator back to `state`, then past the draws of num_tokens
        sampled tokens: a step that also drew for drafts it rejected leaves the stream where
        sampling only its kept tokens would have (what skip_draws rebuilds elsewhere)."""
        generator = self._entries[req_id].generator
        generator.set_state(state)
        skip_draws(generator, num_tokens, self.vocab_size, self.device)

    def make_batch(self, req_ids: Sequence[str]) -> SamplingBatch:
        """The batch for this step's rows, in order; O(n) Python + O(penalised rows x vocab)."""
        entries = [self._entries[r] for r in req_ids]
        params = [e.params for e in entries]
        rows = [i for i, e in enumerate(entries) if e.slot >= 0]
        penalties = None
        if rows:
            slots = torch.tensor([entries[i].slot for i in rows], dtype=torch.long,
                                 device=self.device)
            penalties = PenaltyInputs.create(rows, [params[i] for i in rows],
                                             self._counts[slots], self._prompt_mask[slots])
        masks = self.grammars.masks(req_ids) if self.grammars is not None \
            and len(self.grammars) else None
        adjust = self._adjust(entries) if self._ruled else None
        return SamplingBatch.build(params, [e.generator for e in entries], penalties,
                                   self.vocab_size, self.device, masks, adjust)

    def _take_slot(self) -> int:
        if not self._free_slots:
            self._grow(2 * self._counts.shape[0])
        slot = self._free_slots.pop()
        self._counts[slot].zero_()
        self._prompt_mask[slot].zero_()
        return slot

    def _grow(self, capacity: int) -> None:
        old = self._counts.shape[0]
        counts = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self._counts
        mask[:old] = self._prompt_mask
        self._counts, self._prompt_mask = counts, mask
        # Popped from the end: lowest free slot first, keeping the live rows dense.
        self._free_slots.extend(range(capacity - 1, old - 1, -1))
