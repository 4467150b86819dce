"""vLLM's side of `offline_throughput.py --against PYTHON`: run by that interpreter, one engine
(`vllm.LLM`) per process, a JSON spec on stdin and one JSON object on stdout (engine_driver.py).

Imports nothing from tierserve: the interpreter running it has vLLM, not tierserve. The spec
adds to engine_driver's: model (a Hugging Face folder). vLLM's CPU settings (threads binding,
KV cache space, usage stats) come from the environment the parent sets.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_driver import Outputs, count_files, serve  # noqa: E402

import torch  # noqa: E402
import vllm  # noqa: E402  (imported before the spec is read: import time counts in cold start)
import vllm.envs  # noqa: E402


class VllmEngine:
    def __init__(self, spec: dict) -> None:
        self._cache = os.path.join(vllm.envs.VLLM_CACHE_ROOT, "torch_compile_cache")
        self._cache_files = count_files(self._cache)
        self.llm = vllm.LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
                            max_model_len=spec["max_model_len"], enable_prefix_caching=True,
                            seed=0)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Outputs:
        params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]

    def info(self) -> dict:
        new_files = count_files(self._cache) - self._cache_files
        return {"version": vllm.__version__, "torch": torch.__version__,
                "compile_cache": self._cache, "compile_cache_files_before": self._cache_files,
                "compile_cache_new_files": new_files,
                "compile_cache_warm": self._cache_files > 0 and new_files == 0}

    def close(self) -> None:
        engine = getattr(self.llm.llm_engine, "engine_core", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()


if __name__ == "__main__":
    serve(VllmEngine)
