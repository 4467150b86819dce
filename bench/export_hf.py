"""The default GGUF model as a Hugging Face folder (config.json, safetensors, tokenizer), for
engines that read only that (vLLM, in `offline_throughput.py --against`). Nothing is
downloaded: the weights are tierserve's loader's (the GGUF the project ships, dequantized to
fp32 with the q/k rows in HF order), the config and tokenizer are transformers' reading of
the GGUF.

--noise F adds Gaussian noise of F times each matrix's RMS to every weight matrix (seeded,
fp32): a dense checkpoint with no exact low-bit structure, as a user's own fine-tune would be
(`--noise 0.01` is the dense model of issue 27; offline_throughput.py --model dense-noise).

The folder is cached under the temp dir, keyed by the GGUF file and the noise; a new export is
checked before it is kept: transformers on the folder must give tierserve's greedy tokens on a
few chat prompts (tierserve on the GGUF, or with noise on the folder itself).

Usage: python bench/export_hf.py [--gguf PATH] [--out DIR] [--noise 0.01]   (prints the folder)
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile

import torch

CHECK_MESSAGES = ("What is the capital of France?", "Write a haiku about the sea.",
                  "List three prime numbers.", "hi")
CHECK_TOKENS = 16


NOISE_SEED = 27


def cached_folder(gguf_path: str, noise: float = 0.0) -> str:
    stat = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}"
    if noise:
        key += f":noise={noise!r}:{NOISE_SEED}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"tierserve-hf-{digest}")


def export_hf(gguf_path: str | None = None, out: str | None = None, noise: float = 0.0) -> str:
    """The HF folder of gguf_path (default: the default model), its matrices with `noise`
    RMS-relative Gaussian noise added, exported and checked on the first call, then reused."""
    from tierserve.workers.model.loader import default_model_path
    gguf_path = gguf_path or default_model_path()
    out = out or cached_folder(gguf_path, noise)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    staging = tempfile.mkdtemp(prefix=os.path.basename(out) + ".", dir=os.path.dirname(out))
    try:
        _export(gguf_path, staging, noise)
        check_greedy(staging, staging if noise else gguf_path)
        os.chmod(staging, 0o755)
        os.rename(staging, out)  # whole folders only: a concurrent export's rename loses
    except OSError:
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _export(gguf_path: str, folder: str, noise: float = 0.0) -> None:
    """transformers will not save a model it loaded from a GGUF, so only its config and
    tokenizer come from there."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tierserve.workers.model.loader import iter_weights
    src, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    config.dtype = torch.float32
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]  # vLLM's key
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(folder)
    weights = {hf_name: tensor.contiguous() for hf_name, tensor in iter_weights(gguf_path)}
    if noise:
        gen = torch.Generator().manual_seed(NOISE_SEED)
        for name in sorted(weights):
            w = weights[name]
            if w.dim() == 2:
                rms = w.pow(2).mean().sqrt()
                weights[name] = w + torch.randn(w.shape, generator=gen) * (noise * rms)
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def check_greedy(folder: str, model_path: str) -> None:
    """Raises unless transformers on `folder` and tierserve on `model_path` pick the same
    greedy tokens (CHECK_TOKENS, or up to EOS) for each CHECK_MESSAGES prompt (fp32)."""
    from transformers import AutoModelForCausalLM

    from tierserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=CHECK_TOKENS)
    with LLM(model_path, dtype="float32") as llm:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": m}])
                   for m in CHECK_MESSAGES]
        ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, expected in zip(prompts, ours):
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=CHECK_TOKENS, do_sample=False,
                                 pad_token_id=model.config.eos_token_id)
        theirs = out[0, len(prompt):].tolist()
        if theirs != expected:
            raise RuntimeError(f"the export at {folder} disagrees with tierserve on {model_path}: "
                               f"greedy {theirs} vs {expected}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", help="default: the default model's GGUF")
    ap.add_argument("--out", help="default: a folder under the temp dir, keyed by the GGUF")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="Gaussian noise added to each matrix, relative to its RMS")
    args = ap.parse_args()
    print(export_hf(args.gguf, args.out, args.noise))


if __name__ == "__main__":
    main()
