"""Runs one SchedulerOutput: apply the diff, build inputs, forward, sample (rank 0)."""
from __future__ import annotations

import numpy as np
import torch

from tierserve.scheduler.messages import ModelRunnerOutput, SampleLogprobs, SchedulerOutput
from tierserve.scheduler.params import Pooling
from tierserve.workers import parallel
from tierserve.workers.cuda_graphs import DecodeGraphs
from tierserve.workers.kv_pool import copy_blocks
from tierserve.workers.lora_adapters import LoRAAdapters
from tierserve.workers.input_batch import InputBatch, StepInputs
from tierserve.workers.model.llama import LlamaForCausalLM
from tierserve.workers.sampler import Sampler, SamplerOutput, SamplingStateTable
from tierserve.workers.spec_decode import SampleRows
from tierserve.workers.structured import GrammarMatchers
from tierserve.workers.tier_copier import TierCopier

__all__ = ["ModelRunner", "PromptPositions"]


class PromptPositions:
    """A step's prompt-logprob work: packed token indices, the prompt token each one's logits
    score (the next one), and which scheduled request (with its top-n) owns each run."""

    def __init__(self) -> None:
        self.owners: list[tuple[int, int, int]] = []  # (scheduled index, count, top-n)
        self._packed: list[np.ndarray] = []
        self._targets: list[np.ndarray] = []

    def add(self, scheduled: int, packed: np.ndarray, targets: np.ndarray, k: int) -> None:
        self.owners.append((scheduled, len(packed), k))
        self._packed.append(packed)
        self._targets.append(targets)

    @property
    def packed(self) -> np.ndarray:
        return np.concatenate(self._packed)

    def logprobs(self, logits: torch.Tensor, num_scheduled: int
                 ) -> list[list[SampleLogprobs] | None]:
        """logits float32[positions, vocab] of self.packed -> per scheduled request, the
        log-softmax of each scored prompt token and the top-n there."""
        lp = logits.float().log_softmax(dim=-1)
        targets = torch.from_numpy(np.concatenate(self._targets)).to(lp.device)
        chosen = lp.gather(1, targets.unsqueeze(1))
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        k = max(o[2] for o in self.owners)
        top_lps, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], targets[:, None][:, :0])
        top_lps, top_ids = top_lps.tolist(), top_ids.tolist()
        chosen, targets = chosen.squeeze(1).tolist(), targets.tolist()
        out: list[list[SampleLogprobs] | None] = [None] * num_scheduled
        i = 0
        for scheduled, count, n in self.owners:
            out[scheduled] = [SampleLogprobs([targets[p]] + top_ids[p][:n],
                                             [chosen[p]] + top_lps[p][:n], ranks[p])
                              for p in range(i, i + count)]
            i += count
        return out


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list, block_size: int,
                 device: torch.device, is_driver: bool, seed: int, *,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 append_sampled: bool = False, tokenizer_file: str | None = None,
                 decode_graphs: bool = False, loras: LoRAAdapters | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # Only the driver rank samples; the others run the forward for their collectives.
        self.is_driver = is_driver
        # Async scheduling: every rank appends the sampled tokens to its rows itself (the
        # driver broadcasts them), since the scheduler schedules them before it knows them.
        self.append_sampled = append_sampled
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(generator, model.backend)
        # Capacities are the engine's limits where known; the batch grows past them on demand
        # (preempted requests keep their rows while others run).
        vocab = model.config.vocab_size
        grammars = GrammarMatchers(tokenizer_file, vocab, model.config.eos_token_ids) \
            if is_driver else None
        table = SamplingStateTable(vocab, device, grammars=grammars,
                                   eos_token_ids=model.config.eos_token_ids)
        self.batch = InputBatch(block_size, table,
                                device=device, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len)
        # The rank's tier copier; the Worker gives it CPU slots and an SSD folder where the
        # engine has tiers (none: every step's copy list is empty).
        self.tiers = TierCopier(kv_caches, 0, device)
        # The rank's LoRA adapters, where the engine enables LoRA.
        self.loras = loras
        # Decode-only steps replayed from CUDA graphs (decode_graphs: on a CUDA device at TP=1).
        self.graphs = DecodeGraphs(
            model, kv_caches, block_size, max_batch=min(max_num_seqs or 256, 256),
            max_model_len=max_model_len or model.config.max_position_embeddings,
            capture=device.type == "cuda") if decode_graphs else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        cow = (lambda: copy_blocks(self.kv_caches, out.copy_src, out.copy_dst)
               ) if out.copy_src else None
        # Before the forward: device -> CPU copies before a block id is reused, CPU -> device
        # ones before it is read. Then every rank agrees on the async copies completed so far.
        self.tiers.run(out.tier_copies, cow)
        done, failed = self.tiers.agree()
        result = self._execute(out)
        result.tier_done, result.tier_failed = done, failed
        return result

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.batch.apply(out)
        if self.loras is not None and out.scheduled_new_reqs:
            self.loras.admit(out.scheduled_new_reqs, self.batch.lora_digests)
        if not out.num_scheduled_tokens:
            return ModelRunnerOutput(out.step_id)
        inputs = self.batch.prepare(out)
        sampled = [-1] * len(out.num_scheduled_tokens)
        if self.is_driver and len(inputs.sample_rows):
            self.batch.sampling.prefetch(inputs.sample_req_ids)
        rows = SampleRows.of(inputs, self.batch)  # each sampler's last token, and its drafts
        prompt = self._prompt_positions(inputs)
        # Sorted: the forward keeps rows in order (and every row, unindexed, when all are kept).
        keep = rows.keep if prompt is None else np.union1d(rows.keep, prompt.packed)
        if not len(keep):  # a partial prefill chunk alone: its K/V is the step's whole work
            keep = np.zeros(1, dtype=np.int64)
        hidden = self._forward(inputs, torch.from_numpy(keep).to(self.device))
        if not len(inputs.sample_rows) and prompt is None:
            return ModelRunnerOutput(out.step_id, sampled)
        reply = self._sample(out, inputs, rows, prompt, keep, hidden, sampled)
        if self.is_driver and self.batch.pooling_rows:
            reply.pooled = self._pooled(inputs, rows, keep, hidden, len(sampled))
        return reply

    def _sample(self, out: SchedulerOutput, inputs: StepInputs, rows: SampleRows,
                prompt: "PromptPositions | None", keep: np.ndarray, hidden: torch.Tensor,
                sampled: list[int]) -> ModelRunnerOutput:
        batch = self.batch.sampling.make_batch(rows.req_ids) \
            if self.is_driver and len(inputs.sample_rows) else None
        # A greedy route exists only without tensor parallelism, so the ranks never disagree
        # on whether compute_logits (with its collectives) runs.
        if batch is not None and batch.plain_greedy and prompt is None:
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                return self._to_output(out, inputs, rows, SamplerOutput(tokens), sampled)
        logits = self.model.compute_logits(hidden)  # None off the driver rank
        if not self.is_driver:
            if self.append_sampled and len(inputs.sample_rows):
                width = 1 + max(out.num_spec_tokens, default=0)
                tokens = torch.empty(len(inputs.sample_rows), width, dtype=torch.long,
                                     device=self.device)
                self.batch.append_sampled(inputs, parallel.tp_broadcast(tokens))
            return ModelRunnerOutput(out.step_id)
        prompt_lps = None
        if prompt is not None:
            at = torch.from_numpy(np.searchsorted(keep, prompt.packed)).to(logits.device)
            prompt_lps = prompt.logprobs(logits.index_select(0, at), len(sampled))
            logits = logits.index_select(0, torch.from_numpy(
                np.searchsorted(keep, rows.keep)).to(logits.device))
        if batch is None:
            return ModelRunnerOutput(out.step_id, sampled, prompt_logprobs=prompt_lps)
        seeded = self.batch.sampling.seeded_states(rows.req_ids) if rows.drafts else None
        result = self.sampler(logits, batch)
        reply = self._to_output(out, inputs, rows, result, sampled, seeded)
        if prompt_lps is not None:
            reply.prompt_logprobs = prompt_lps
        return reply

    def _pooled(self, inputs: StepInputs, rows: SampleRows, keep: np.ndarray,
                hidden: torch.Tensor, num_scheduled: int) -> list[bytes]:
        """Per scheduled request, the pooled final hidden state of an embedding request's
        sampled row (its last prompt token), float32 bytes; b"" for the others."""
        pooled = [b""] * num_scheduled
        packed = inputs.order[inputs.sample_rows].tolist()
        for j, rid in enumerate(inputs.sample_req_ids):
            kind = self.batch.params_of(rid).pooling
            if not kind:
                continue
            # hidden holds keep's rows (all of them, in order, where keep is every row).
            vec = hidden[int(np.searchsorted(keep, rows.keep[rows.first[j]]))].float()
            if kind == Pooling.LAST_NORMALIZED:
                vec = vec / vec.norm().clamp_min(1e-12)
            pooled[packed[j]] = vec.cpu().numpy().tobytes()
        return pooled

    def _prompt_positions(self, inputs: StepInputs) -> "PromptPositions | None":
        """The packed tokens whose logits score a prompt token this step (prompt logprobs)."""
        wanted = self.batch.prompt_logprob_rows
        if not wanted:
            return None
        firsts = np.cumsum(inputs.query_lens) - inputs.query_lens
        found = PromptPositions()
        for j, row in enumerate(inputs.rows.tolist()):
            if row not in wanted:
                continue
            end = int(inputs.seq_lens[j])
            start = end - int(inputs.query_lens[j])
            stop = min(end, int(self.batch.num_prompt[row]) - 1)
            if stop >= int(self.batch.num_prompt[row]) - 1:
                wanted.discard(row)  # its last prompt position is scored in this step
            if stop > start:
                found.add(int(inputs.order[j]), firsts[j] + np.arange(stop - start),
                          self.batch.token_ids[row, start + 1:stop + 1],
                          self.batch.params[row].prompt_logprobs)
        return found if found.owners else None

    def _forward(self, inputs: StepInputs, keep: torch.Tensor) -> torch.Tensor:
        """The final hidden states of the rows in keep: [len(keep), hidden_size]."""
        input_ids, positions, attn = self.batch.forward_inputs(inputs)
        if len(keep) == len(inputs.positions):
            keep = None  # every row: nothing to skip (a decode-only step)
        lora = self.loras is not None and self.loras.begin(
            self.batch.lora_digests[inputs.token_rows], keep)
        try:
            bucket = None if keep is not None or lora or self.graphs is None \
                else self.graphs.bucket_of(attn)
            if bucket is not None:
                return self.graphs.run(input_ids, positions, attn, bucket)
            return self.model(input_ids, positions, attn, self.kv_caches, keep)
        finally:
            if lora:
                self.loras.end()

    def _rewind_rejected(self, rows: SampleRows, accepted: list[int],
                         seeded: dict[str, torch.Tensor]) -> None:
        """A seeded sequence drew a row of uniforms for each of its step's rows; where it
        rejected drafts, its stream goes back to having advanced by its kept tokens alone. So
        its tokens are those of decoding one token at a time, and a continuation elsewhere
        (which skips one draw per token) resumes the same stream."""
        for s, num_accepted in enumerate(accepted):
            req_id = rows.req_ids[int(rows.first[s])]
            if req_id in seeded and num_accepted < len(rows.drafts[s]):
                self.batch.sampling.rewind(req_id, seeded[req_id], num_accepted + 1)

    def _to_output(self, out: SchedulerOutput, inputs: StepInputs, rows: SampleRows,
                   result: SamplerOutput, sampled: list[int],
                   seeded: dict[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
        final, accepted, step_tokens = rows.accept(result.token_ids.cpu().numpy())
        if seeded:
            self._rewind_rejected(rows, accepted, seeded)
        if self.append_sampled:
            width = 1 + max(out.num_spec_tokens, default=0)
            tokens = torch.full((len(final), width), -1, dtype=torch.long)
            tokens[:, : step_tokens.shape[1]] = torch.from_numpy(step_tokens)
            self.batch.append_sampled(inputs, parallel.tp_broadcast(tokens.to(self.device)))
        token_ids = final.tolist()
        packed = inputs.order[inputs.sample_rows].tolist()
        for i, token in zip(packed, token_ids):
            sampled[i] = token
        num_accepted = []
        if accepted:
            num_accepted = [0] * len(sampled)
            for i, n in zip(packed, accepted):
                num_accepted[i] = n
        logprobs: list[SampleLogprobs | None] = []
        if result.logprobs is not None:
            # Requests with logprobs have no drafts: one row each, its first.
            logprobs = [None] * len(sampled)
            lp = result.logprobs
            top_ids, top_lps = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
            chosen, ranks = lp.sampled_logprobs.tolist(), lp.sampled_ranks.tolist()
            for token, i, rid, j in zip(token_ids, packed, inputs.sample_req_ids,
                                        rows.first.tolist()):
                params = self.batch.params_of(rid)
                k = params.logprobs
                if k is None:
                    continue
                picked_lps, picked_ranks = lp.chosen.get(j, ([], []))
                logprobs[i] = SampleLogprobs(
                    [token] + top_ids[j][:k] + (params.logprob_token_ids or []),
                    [chosen[j]] + top_lps[j][:k] + picked_lps, ranks[j], picked_ranks)
        return ModelRunnerOutput(out.step_id, sampled, logprobs, num_accepted=num_accepted)
