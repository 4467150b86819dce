"""bench/lora.py's cases on vLLM, run by a vLLM venv's python: `python lora_vllm.py SPEC OUT`
with SPEC a JSON file (model, prompts, tokens, adapter folders, rank, repeats); writes the
results to OUT as JSON (vLLM logs to stdout). The environment (threads, KV space, usage stats)
comes from the parent."""
import json
import sys

from lora_timing import measure


def main() -> None:
    import vllm
    from vllm.lora.request import LoRARequest

    spec = json.load(open(sys.argv[1]))
    llm = vllm.LLM(model=spec["model"], dtype="float32", enable_lora=True,
                   max_loras=len(spec["adapters"]), max_lora_rank=spec["rank"],
                   enable_prefix_caching=False, max_model_len=1024, seed=0)
    adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(spec["adapters"])]

    def generate(prompts, max_tokens, lora):
        params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora,
                     use_tqdm=False)

    best = measure(generate, spec["prompts"], spec["tokens"], adapters, spec["repeats"])
    with open(sys.argv[2], "w") as f:
        json.dump({"version": vllm.__version__, "best": best}, f)


if __name__ == "__main__":
    main()
