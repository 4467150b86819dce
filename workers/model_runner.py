"""Runs one SchedulerOutput: apply the diff, build inputs, forward, sample (rank 0)."""
from __future__ import annotations

import numpy as np
import torch

from tierserve.scheduler.messages import ModelRunnerOutput, SampleLogprobs, SchedulerOutput
from tierserve.workers import parallel
from tierserve.workers.kv_pool import copy_blocks
from tierserve.workers.input_batch import InputBatch, StepInputs
from tierserve.workers.model.llama import LlamaForCausalLM
from tierserve.workers.sampler import Sampler, SamplerOutput, SamplingStateTable
from tierserve.workers.spec_decode import SampleRows
from tierserve.workers.structured import GrammarMatchers
from tierserve.workers.tiers import TierStore

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list, block_size: int,
                 device: torch.device, is_driver: bool, seed: int, *,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 append_sampled: bool = False, tokenizer_file: str | None = None) -> None:
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
        # The rank's CPU and SSD tiers, where the engine has them (set by the Worker).
        self.tiers: TierStore | None = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        cow = (lambda: copy_blocks(self.kv_caches, out.copy_src, out.copy_dst)
               ) if out.copy_src else None
        if self.tiers is not None:
            # Before the forward: swap-outs before a block id is reused, swap-ins before it is
            # read. Then every rank agrees on the async copies completed so far.
            self.tiers.run(out.tier_ops, cow)
            done, failed = self.tiers.agree()
        elif out.tier_ops:
            raise RuntimeError("tier copies were sent to a rank without tiers")
        else:
            if cow is not None:
                cow()
            done, failed = [], []
        result = self._execute(out)
        result.tier_done, result.tier_failed = done, failed
        return result

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.batch.apply(out)
        if not out.num_scheduled_tokens:
            return ModelRunnerOutput(out.step_id)
        inputs = self.batch.prepare(out)
        sampled = [-1] * len(out.num_scheduled_tokens)
        rows = SampleRows.of(inputs, self.batch)
        # A partial prefill chunk alone: its K/V is the step's whole work.
        keep = rows.keep if len(rows.keep) else np.zeros(1, dtype=np.int64)
        hidden = self._forward(inputs, torch.from_numpy(keep).to(self.device))
        if not len(inputs.sample_rows):
            return ModelRunnerOutput(out.step_id, sampled)
        batch = self.batch.sampling.make_batch(rows.req_ids) if self.is_driver else None
        # A greedy route exists only without tensor parallelism, so the ranks never disagree
        # on whether compute_logits (with its collectives) runs.
        if batch is not None and batch.plain_greedy:
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                return self._to_output(out, inputs, rows, SamplerOutput(tokens), sampled)
        logits = self.model.compute_logits(hidden)  # None off the driver rank
        if not self.is_driver:
            if self.append_sampled:
                width = 1 + max(out.num_spec_tokens, default=0)
                tokens = torch.empty(len(inputs.sample_rows), width, dtype=torch.long,
                                     device=self.device)
                self.batch.append_sampled(inputs, parallel.tp_broadcast(tokens))
            return ModelRunnerOutput(out.step_id)
        result = self.sampler(logits, batch)
        return self._to_output(out, inputs, rows, result, sampled)

    def _forward(self, inputs: StepInputs, keep: torch.Tensor) -> torch.Tensor:
        """The final hidden states of the rows in keep: [len(keep), hidden_size]."""
        input_ids, positions, attn = self.batch.forward_inputs(inputs)
        if len(keep) == len(inputs.positions):
            keep = None  # every row: nothing to skip (a decode-only step)
        return self.model(input_ids, positions, attn, self.kv_caches, keep)

    def _to_output(self, out: SchedulerOutput, inputs: StepInputs, rows: SampleRows,
                   result: SamplerOutput, sampled: list[int]) -> ModelRunnerOutput:
        final, accepted, step_tokens = rows.accept(result.token_ids.cpu().numpy())
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
                k = self.batch.params_of(rid).logprobs
                if k is None:
                    continue
                logprobs[i] = SampleLogprobs([token] + top_ids[j][:k],
                                             [chosen[j]] + top_lps[j][:k], ranks[j])
        return ModelRunnerOutput(out.step_id, sampled, logprobs, num_accepted=num_accepted)
