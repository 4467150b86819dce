"""Batched token sampler: one call per step turns logits float32[n, vocab] into n token ids.

Order of operations for each row (one row per request that receives a token this step):

  grammar mask (constrained rows: tokens their matcher disallows become -inf; structured.py)
  -> penalties (repetition over prompt + output tokens, as HF / vLLM; presence and frequency over
  output tokens only, OpenAI semantics)
  -> greedy rows: argmax of the penalised logits
  -> random rows: temperature -> top-k -> top-p -> min-p -> exponential race with the row's
     generator (argmax(probs / E), E ~ Exp(1) i.i.d., which samples exactly from probs).

Logprobs are log_softmax of the *raw* model logits (vLLM's default "raw_logprobs"): they describe
the model's distribution, before penalties, temperature and truncation.

Reproducibility: a seeded request owns a torch.Generator and each step it is sampled draws exactly
`vocab` uniforms from it, so its tokens do not depend on batch size or its row position.
The caller must only include rows whose token it keeps (not partial-prefill chunks), otherwise the
generator advances on a discarded draw. Unseeded rows share one generator.

Two ways to build a SamplingBatch, producing identical batches:
  * SamplingBatch.from_token_ids: from full token lists, O(context) work (tests, one-off use).
  * SamplingStateTable: the worker's persistent per-request state. Penalty requests own a slot
    holding an output-token count row and a prompt-token mask row; each step adds one count per
    request in a single batched scatter, so penalties cost O(batch x vocab) device work per step
    and O(batch) Python work, independent of context length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tierserve.scheduler.params import SamplingParams
from tierserve.workers.backends.base import Backend
from tierserve.workers.backends.portable import torch_backend
from tierserve.workers.structured import GrammarMatchers
from tierserve.workers.token_rules import TokenRules

__all__ = [
    "SAMPLING_EPS",
    "apply_min_p_",
    "apply_penalties",
    "apply_top_k_",
    "apply_top_p_",
    "compute_logprobs",
    "LogprobsOutput",
    "PenaltyInputs",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingStateTable",
    "has_penalties",
    "is_greedy",
    "make_generator",
]

# Temperatures below this are treated as greedy: logits / T would overflow to inf and softmax
# would return NaN; the limit T -> 0 of sampling is argmax anyway.
SAMPLING_EPS = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < SAMPLING_EPS


def has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


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
class PenaltyInputs:
    """Penalty state for the m rows of a batch that have any penalty (m <= n)."""

    rows: torch.Tensor           # long[m]: batch row of each penalised request
    output_counts: torch.Tensor  # int32[m, vocab]: occurrences of each token in the output
    prompt_mask: torch.Tensor    # bool[m, vocab]: token occurs in the prompt
    repetition: torch.Tensor     # float32[m, 1]
    presence: torch.Tensor       # float32[m, 1]
    frequency: torch.Tensor      # float32[m, 1]
    any_repetition: bool         # some row has repetition_penalty != 1
    any_additive: bool           # some row has a presence or frequency penalty

    @classmethod
    def create(cls, rows: Sequence[int], params: Sequence[SamplingParams],
               output_counts: torch.Tensor, prompt_mask: torch.Tensor) -> "PenaltyInputs":
        device = output_counts.device

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        return cls(
            rows=torch.tensor(list(rows), dtype=torch.long, device=device),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            repetition=column([p.repetition_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            any_repetition=any(p.repetition_penalty != 1.0 for p in params),
            any_additive=any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                             for p in params),
        )


@dataclass
class SamplingBatch:
    """Everything the sampler needs for one step, as device tensors built once per step.

    Per-row sampling parameters are stored for the random (non-greedy) rows only; `random_rows`
    maps them back to batch rows. A parameter tensor is None when no random row uses it.
    """

    num_rows: int
    vocab_size: int
    greedy_rows: torch.Tensor | None     # long[g]; None when no row is greedy
    random_rows: torch.Tensor | None     # long[r]; None when no row is random
    all_random: bool                     # random_rows covers every row in order
    temperature: torch.Tensor | None     # float32[r, 1]
    top_k: torch.Tensor | None           # long[r], vocab_size where disabled
    top_k_max: int                       # largest enabled top_k (0 when top_k is None)
    top_p: torch.Tensor | None           # float32[r]
    min_p: torch.Tensor | None           # float32[r]
    generators: dict[int, torch.Generator]  # random-row index -> seeded generator
    penalties: PenaltyInputs | None
    max_num_logprobs: int | None         # largest `logprobs` asked for; None when nobody asks
    # Constrained rows (long[c]) and what their grammars add: float32[c, vocab], 0 or -inf.
    masks: tuple[torch.Tensor, torch.Tensor] | None = None
    # Rows with token rules (long[k]) and what each adds to its logits (float32[k, vocab]).
    adjust: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row is greedy without penalties, logprobs, masks or token rules: a bare
        argmax suffices."""
        return (self.random_rows is None and self.penalties is None
                and self.max_num_logprobs is None and self.masks is None
                and self.adjust is None)

    @classmethod
    def build(cls, params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None], penalties: PenaltyInputs | None,
              vocab_size: int, device: torch.device | str,
              masks: tuple[list[int], torch.Tensor] | None = None,
              adjust: tuple[list[int], torch.Tensor] | None = None) -> "SamplingBatch":
        if len(generators) != len(params):
            raise ValueError("need one generator slot (or None) per row")
        greedy = [i for i, p in enumerate(params) if is_greedy(p)]
        random = [i for i, p in enumerate(params) if not is_greedy(p)]
        rp = [params[i] for i in random]
        top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in rp]
        asked = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            num_rows=len(params),
            vocab_size=vocab_size,
            greedy_rows=tensor(greedy, torch.long) if greedy else None,
            random_rows=tensor(random, torch.long) if random else None,
            all_random=len(random) == len(params),
            temperature=(tensor([[p.temperature] for p in rp], torch.float32)
                         if any(p.temperature != 1.0 for p in rp) else None),
            top_k=tensor(top_ks, torch.long) if any(k < vocab_size for k in top_ks) else None,
            top_k_max=max((k for k in top_ks if k < vocab_size), default=0),
            top_p=(tensor([p.top_p for p in rp], torch.float32)
                   if any(p.top_p < 1.0 for p in rp) else None),
            min_p=(tensor([p.min_p for p in rp], torch.float32)
                   if any(p.min_p > 0.0 for p in rp) else None),
            generators={j: generators[i] for j, i in enumerate(random)
                        if generators[i] is not None},
            penalties=penalties,
            max_num_logprobs=max(asked) if asked else None,
            masks=None if masks is None else (tensor(masks[0], torch.long),
                                              masks[1].to(device)),
            adjust=None if adjust is None else (tensor(adjust[0], torch.long), adjust[1]),
        )

    @classmethod
    def from_token_ids(cls, params: Sequence[SamplingParams],
                       prompt_token_ids: Sequence[Sequence[int]],
                       output_token_ids: Sequence[Sequence[int]],
                       generators: Sequence[torch.Generator | None], vocab_size: int,
                       device: torch.device | str = "cpu") -> "SamplingBatch":
        """Build from full token lists (O(context)); the persistent path is SamplingStateTable."""
        rows = [i for i, p in enumerate(params) if has_penalties(p)]
        penalties = None
        if rows:
            counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=device)
            mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
            for j, i in enumerate(rows):
                _fill_penalty_row(counts[j], mask[j], prompt_token_ids[i], output_token_ids[i])
            penalties = PenaltyInputs.create(rows, [params[i] for i in rows], counts, mask)
        return cls.build(params, generators, penalties, vocab_size, device)


def _fill_penalty_row(counts: torch.Tensor, mask: torch.Tensor, prompt_token_ids: Sequence[int],
                      output_token_ids: Sequence[int]) -> None:
    """counts: int32[vocab] (zeroed), mask: bool[vocab] (zeroed), filled in place."""
    device = counts.device
    if len(prompt_token_ids):
        mask[torch.as_tensor(list(prompt_token_ids), dtype=torch.long, device=device)] = True
    if len(output_token_ids):
        ids = torch.as_tensor(list(output_token_ids), dtype=torch.long, device=device)
        counts.index_put_((ids,), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)


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
            _fill_penalty_row(self._counts[slot], self._prompt_mask[slot], prompt_token_ids,
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

    def append_tokens(self, req_ids: Sequence[str], token_ids: torch.Tensor | Sequence[int]) -> None:
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


@dataclass
class LogprobsOutput:
    """Logprobs of the raw model distribution for every row; k = batch.max_num_logprobs.

    Rows that asked for fewer than k (or none) should take the first `logprobs` columns."""

    sampled_logprobs: torch.Tensor  # float32[n]: logprob of the sampled token
    sampled_ranks: torch.Tensor     # long[n]: 1 + number of tokens with a strictly higher logprob
    top_token_ids: torch.Tensor     # long[n, k], by descending logprob
    top_logprobs: torch.Tensor      # float32[n, k]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # long[n]
    logprobs: LogprobsOutput | None = None


def greedy(logits: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """Row-wise argmax [n, vocab] -> long[n], the first index on ties (as argmax), by the
    backend's argmax_rows."""
    return (backend or torch_backend()).argmax_rows(logits)


class Sampler:
    """Stateless apart from the shared generator used by unseeded random rows.

    The input logits are never modified.
    """

    def __init__(self, generator: torch.Generator | None = None,
                 backend: Backend | None = None) -> None:
        # None: unseeded rows draw from torch's default generator for the logits' device.
        self.generator = generator
        self.backend = backend or torch_backend()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match "
                             f"{batch.num_rows} batch rows")
        if batch.plain_greedy:
            return SamplerOutput(greedy(logits, self.backend))
        logits = raw = logits.float()
        owned = False
        if batch.masks is not None:
            logits, owned = masked(logits, *batch.masks), True
        if batch.adjust is not None:
            rows, add = batch.adjust
            logits = logits.index_copy(0, rows, logits.index_select(0, rows) + add)
            owned = True
        if batch.penalties is None:
            token_ids = self._choose(logits, batch, owned=owned)
        else:
            token_ids = self._choose(apply_penalties(logits, batch.penalties), batch, owned=True)
        logprobs = None
        if batch.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw, token_ids, batch.max_num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def _choose(self, x: torch.Tensor, batch: SamplingBatch, owned: bool) -> torch.Tensor:
        """x: penalised logits float32[n, vocab] -> long[n]; `owned`: x may be modified."""
        if batch.random_rows is None:
            return greedy(x, self.backend)
        if batch.all_random:
            xr = x if owned else x.clone()
        else:
            xr = x.index_select(0, batch.random_rows)
        sampled = self._sample(xr, batch)
        if batch.all_random:
            return sampled
        tokens = torch.empty(batch.num_rows, dtype=torch.long, device=x.device)
        tokens[batch.greedy_rows] = greedy(x.index_select(0, batch.greedy_rows), self.backend)
        tokens[batch.random_rows] = sampled
        return tokens

    def _sample(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """x: float32[r, vocab], a private copy of the random rows, modified in place."""
        if batch.temperature is not None:
            x.div_(batch.temperature)
        if batch.top_k is not None:
            apply_top_k_(x, batch.top_k, batch.top_k_max)
        if batch.top_p is not None:
            apply_top_p_(x, batch.top_p)
        if batch.min_p is not None:
            apply_min_p_(x, batch.min_p)
        probs = x.softmax(dim=-1)
        return probs.div_(self._exponential_noise(probs, batch)).argmax(dim=-1)

    def _exponential_noise(self, like: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exp(1) noise float32[r, vocab]; a seeded row draws exactly `vocab` uniforms from its own
        generator. -log(u) with u in [0, 1) is in (0, inf]: never 0, so probs / noise is never
        NaN (u == 0 gives inf, i.e. that token cannot win), and it is several times cheaper on CPU
        than Tensor.exponential_."""
        noise = torch.empty_like(like)
        if len(batch.generators) < like.shape[0]:
            noise.uniform_(generator=self.generator)
        for row, generator in batch.generators.items():
            noise[row].uniform_(generator=generator)
        return noise.log_().neg_()


def masked(logits: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A copy of logits float32[n, vocab] where each constrained row keeps only the tokens its
    grammar allows (bias: float32[c, vocab], -inf on the others)."""
    if len(rows) == logits.shape[0]:  # rows are in batch order: every row is constrained
        return logits + bias
    x = logits.index_select(0, rows)
    x.add_(bias)
    return logits.index_copy(0, rows, x)


def apply_penalties(logits: torch.Tensor, pen: PenaltyInputs) -> torch.Tensor:
    """Returns a penalised copy of logits float32[n, vocab]; only pen.rows change.

    Repetition (HF / CTRL): a logit of a token seen in prompt or output is divided by the penalty
    when positive, multiplied when negative. Then, over output tokens only,
    logit -= frequency * count + presence * (count > 0).
    """
    x = logits.index_select(0, pen.rows)
    counts = pen.output_counts
    if pen.any_repetition:
        seen = pen.prompt_mask | (counts > 0)
        scaled = torch.where(x > 0, x / pen.repetition, x * pen.repetition)
        x = torch.where(seen, scaled, x)
    if pen.any_additive:
        x -= pen.frequency * counts.to(x.dtype) + pen.presence * (counts > 0).to(x.dtype)
    return logits.index_copy(0, pen.rows, x)


def apply_top_k_(x: torch.Tensor, top_k: torch.Tensor, top_k_max: int) -> None:
    """Keep each row's top_k largest logits (ties with the k-th value are all kept); in place.

    x: float32[r, vocab]; top_k: long[r], vocab where disabled."""
    vocab = x.shape[1]
    values = x.topk(min(top_k_max, vocab), dim=-1).values
    kth = values.gather(1, (top_k.clamp(max=top_k_max) - 1).unsqueeze(1))
    kth = torch.where(top_k.unsqueeze(1) >= vocab, torch.full_like(kth, -float("inf")), kth)
    x.masked_fill_(x < kth, -float("inf"))


def apply_top_p_(x: torch.Tensor, top_p: torch.Tensor, max_candidates: int | None = None) -> None:
    """Nucleus truncation on x float32[r, vocab] (already top-k masked), in place.

    Keeps the smallest set of most likely tokens whose probability (under x, i.e. renormalised
    after top-k) reaches top_p: token i, in descending order, is kept iff the mass before it is
    < top_p, so the most likely token always survives. Tokens tied with the last kept logit are
    kept too. A full sort of the vocabulary is slow on CPU, so there only the top
    `max_candidates` (default 1024) are sorted, and rows whose nucleus is wider fall back to a
    full sort. On accelerators the sort is cheap and is always used (no host sync)."""
    vocab = x.shape[1]
    if max_candidates is None:
        max_candidates = 1024 if x.device.type == "cpu" else vocab
    k = min(vocab, max_candidates)
    threshold, resolved = _top_p_threshold(x, top_p, k)
    if k < vocab and not bool(resolved.all()):
        rows = (~resolved).nonzero().squeeze(1)
        threshold[rows] = _top_p_threshold(x[rows], top_p[rows], vocab)[0]
    x.masked_fill_(x < threshold, -float("inf"))


def _top_p_threshold(x: torch.Tensor, top_p: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """From the k largest logits per row: the smallest kept logit float32[r, 1] (-inf for
    top_p >= 1) and whether the k candidates hold the whole nucleus, bool[r]."""
    values = x.topk(k, dim=-1).values  # descending
    probs = (values - x.logsumexp(dim=-1, keepdim=True)).exp()
    cumulative = probs.cumsum(dim=-1)
    num_kept = ((cumulative - probs) < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)
    threshold = values.gather(1, num_kept - 1)
    threshold.masked_fill_(top_p.unsqueeze(1) >= 1.0, -float("inf"))
    resolved = (cumulative[:, -1] >= top_p) | (top_p >= 1.0)
    return threshold, resolved


def apply_min_p_(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with prob < min_p * max prob, in place on x float32[r, vocab].

    prob_i / prob_max = exp(x_i - x_max), so the test is done on logits: it is unaffected by
    earlier truncation (the max token always survives top-k / top-p) and needs no softmax."""
    threshold = x.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    x.masked_fill_(x < threshold, -float("inf"))


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsOutput:
    """logits: raw float32[n, vocab]; token_ids: long[n] sampled tokens."""
    logprobs = logits.log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = token_ids.new_empty(logprobs.shape[0], 0)
    return LogprobsOutput(sampled.squeeze(1), ranks, top_ids, top_logprobs)
