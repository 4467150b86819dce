"""What quantization at load costs in quality: perplexity on a fixed text and greedy agreement
with the unquantized model, per `quantization` (engine option) on one checkpoint.

- `ppl_<config>`: perplexity of TEXT (about 1,100 tokens, written for this bench and never
  changed, so figures compare across versions), teacher-forced in chunks of --chunk tokens
  through the paged model on the kernel backend this CPU runs; `ppl_ratio_<config>` over the
  unquantized model's.
- `greedy_agree_<config>`: of --prompts chat prompts x --tokens greedy tokens through the engine,
  the share of outputs identical to the unquantized engine's; `greedy_prefix_<config>`: the mean
  share of each output before the first differing token.

Usage: python bench/quality.py [--json] [--model dense-noise|PATH] [--dtype float32]
           [--quantizations q8_0,q4_1] [--prompts 16] [--tokens 64]
"""
from __future__ import annotations

import argparse
import math
import os

import torch

os.environ.setdefault("TIERSERVE_CPU_KERNELS", "sync")

from offline_throughput import make_chat_prompts, resolve_model  # noqa: E402
from report import emit  # noqa: E402

TEXT = """\
The lighthouse keeper wrote in his log every evening, whether or not anything had happened. \
Most nights nothing had. The lamp was lit at dusk, the clockwork that turned the lens was wound \
every four hours, and the fog signal was tested on the first day of each month. In winter the \
storms came from the north-west and the spray reached the gallery windows; in summer the sea \
lay so still that the rocks below showed their weed through clear water. He had kept the light \
for eleven years when the letter arrived to say that the station would be made automatic, and \
that a boat would come in the spring to take him and his belongings to the mainland.

He read the letter twice and put it in the drawer with the others. Then he went up the spiral \
stairs, one hundred and twelve of them, and cleaned the lens as he did every morning, although \
it was evening and the lens was already clean. From the gallery he could see the lights of the \
town across the bay, and further off the slow blink of the buoy that marked the shoals. He tried \
to imagine the tower without anyone in it: the lamp turning for nobody, the log left blank, the \
kettle cold on the stove. It seemed to him that the light would not mind, and that this was the \
hardest part to accept.

In the weeks that followed he began to sort his things. There were not many. A shelf of books, \
most of them read more than once; a box of letters from his sister, who lived inland and had \
never seen the sea; a barometer that had belonged to his father; a tin of buttons; a chess set \
with one white knight missing, replaced long ago by a cork. He made two piles, one to take and \
one to leave, and every few days he moved something from one pile to the other. The engineers \
arrived in March to measure the rooms and look at the wiring. They were polite and quick, and \
they spoke about the tower as if it were a machine, which he supposed it was.

On his last night he lit the lamp at dusk, wound the clockwork, and sat at the table with the \
log open in front of him. He wrote the date, the wind, the state of the sea, and the time the \
lamp was lit. Then he wrote that the keeper was leaving in the morning and that the light would \
go on without him. He looked at the sentence for a long time before he closed the book. In the \
morning the boat came early, the sea was calm, and he did not look back until they were halfway \
across the bay. When he did, the tower was small and white against the hills, and in the \
daylight he could not tell whether the lamp was turning.

Years later, people in the town would say that on clear nights they still watched the light \
from the harbour wall, counting the seconds between the flashes as they had done as children. \
The count never changed: four seconds dark, one second bright, four seconds dark again. It was \
the same rhythm the keeper had kept, the same rhythm the machine now kept without him, and the \
ships that passed the shoals at night neither knew nor needed to know the difference.
"""


def kernel_backend_here():
    from tierserve.runtime import envs
    from tierserve.workers.backends.cpu import kernel_backend
    from tierserve.workers.backends.cpu_features import detect_cpu_features
    return kernel_backend(detect_cpu_features().best_isa(envs.cpu_isa()), envs.cache_dir())


@torch.inference_mode()
def perplexity(path: str | None, dtype: str, quantization: str | None, ids: list[int],
               chunk: int, backend) -> float:
    """exp(mean NLL) of ids[1:] given their prefixes, through the paged model, chunk tokens a
    forward (each chunk attends to the KV of the ones before)."""
    from tierserve.workers.attention import AttentionMetadata
    from tierserve.workers.kv_pool import allocate_kv_cache
    from tierserve.workers.model.loader import default_model_path, load_model
    config, model = load_model(path or default_model_path(), dtype, backend=backend,
                               quantization=quantization)
    block = 16
    blocks = -(-len(ids) // block)
    kv = allocate_kv_cache(config.num_hidden_layers, blocks + 1, block, model.kv_heads_per_rank,
                           config.head_dim, model.dtype, "cpu")
    table = list(range(blocks))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids))
        attn = AttentionMetadata.build(slot_mapping=list(range(start, end)),
                                       query_lens=[end - start], seq_lens=[end],
                                       block_tables=[table[: -(-end // block)]], num_decodes=0,
                                       block_size=block)
        hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), attn, kv)
        logits = model.compute_logits(hidden)
        targets = torch.tensor(ids[start + 1 : end + 1])
        logprobs = torch.log_softmax(logits[: len(targets)].double(), dim=-1)
        nll -= logprobs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count)


def greedy_outputs(path: str | None, dtype: str, quantization: str | None,
                   prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from tierserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(path, dtype=dtype, quantization=quantization) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    same = sum(x == y for x, y in zip(a, b)) / len(a)
    prefix = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x)) / len(x)
              for x, y in zip(a, b)]
    return same, sum(prefix) / len(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default="dense-noise",
                    help="dense-noise (default), an HF folder or .gguf, or default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantizations", default="q8_0,q4_1")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from tierserve.runtime import envs
    from tierserve.runtime.tokenizer import load_tokenizer
    from tierserve.workers.model.loader import default_model_path
    path, _ = resolve_model(None if args.model == "default" else args.model)
    tokenizer = load_tokenizer(path or default_model_path(), cache_dir=envs.cache_dir())
    ids = tokenizer.encode(TEXT)
    prompts = make_chat_prompts(tokenizer, args.prompts)
    backend = kernel_backend_here()
    result: dict = {"model": args.model, "dtype": args.dtype, "backend": backend.name,
                    "text_tokens": len(ids)}
    configs = [None] + [q for q in args.quantizations.split(",") if q]
    reference = None
    for quant in configs:
        name = quant or "dense"
        result[f"ppl_{name}"] = perplexity(path, args.dtype, quant, ids, args.chunk, backend)
        outs = greedy_outputs(path, args.dtype, quant, prompts, args.tokens)
        if reference is None:
            reference = outs
            continue
        result[f"ppl_ratio_{name}"] = result[f"ppl_{name}"] / result["ppl_dense"]
        result[f"greedy_agree_{name}"], result[f"greedy_prefix_{name}"] = agreement(reference,
                                                                                  outs)
    emit(result, args.json)


if __name__ == "__main__":
    main()
