"""tierserve's side of `offline_throughput.py --against`: one engine (`tierserve.LLM`, in
process) per process, a JSON spec on stdin and one JSON object on stdout (engine_driver.py),
so that it starts cold and runs the very code vLLM's driver runs.

The spec adds to engine_driver's: model (null: the default GGUF), cpu_isa, kv_cache_bytes and
engine_options (further LLM options, from offline_throughput.py --engine).
Kernels are built (or loaded from the cache) before the first token (TIERSERVE_CPU_KERNELS=sync
unless set).
"""
from __future__ import annotations

import os
import sys
from importlib.metadata import version
from typing import Iterator

os.environ.setdefault("TIERSERVE_CPU_KERNELS", "sync")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_driver import Outputs, count_files, serve  # noqa: E402

import torch  # noqa: E402
from tierserve import LLM, SamplingParams  # noqa: E402  (before the spec: counts in cold start)
from tierserve.runtime import envs  # noqa: E402


class TierserveEngine:
    def __init__(self, spec: dict) -> None:
        self._cache = envs.cache_dir()  # converted tokenizers and built kernels
        self._cache_files = count_files(self._cache)
        self.llm = LLM(spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                       kv_cache_memory_bytes=spec["kv_cache_bytes"], cpu_isa=spec["cpu_isa"],
                       enable_prefix_caching=True, **spec.get("engine_options", {}))
        self._steps = 0

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Outputs:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]

    def stream_steps(self, prompt: list[int], max_tokens: int) -> Iterator:
        """One greedy request's engine steps, one per next(): its prefill, then a token each."""
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self._steps += 1
        request = self.llm.processors[0].process(f"steps-{self._steps}", prompt, params, 0, None)
        return self.llm.engine.stream_batch([request.request])

    def info(self) -> dict:
        new_files = count_files(self._cache) - self._cache_files
        stats = self.llm.stats()
        return {"version": version("tierserve"), "torch": torch.__version__,
                "cpu_backend": stats["cpu_backend"], "weight_bytes": stats["weight_bytes"],
                "decode_weight_bytes": stats["decode_weight_bytes"],
                "compile_cache": self._cache, "compile_cache_files_before": self._cache_files,
                "compile_cache_new_files": new_files,
                "compile_cache_warm": self._cache_files > 0 and new_files == 0}

    def final_info(self) -> dict:
        stats = self.llm.stats()
        if "spec_acceptance_rate" not in stats:
            return {}
        return {"spec_acceptance": stats["spec_acceptance_rate"],
                "spec_draft_tokens": stats["spec_num_draft_tokens"]}

    def close(self) -> None:
        self.llm.shutdown()


if __name__ == "__main__":
    serve(TierserveEngine)
