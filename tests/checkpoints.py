"""Tiny deterministic Hugging Face checkpoints and a paged-KV driver for model tests.

The checkpoints are random-weight transformers models saved as safetensors; the driver
(`PagedRunner`) plays the scheduler's part for tests: it owns a shuffled free list of block ids,
block tables, slot mappings and AttentionMetadata, so the model sees the same inputs a Worker
would give it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tierserve.workers.attention import AttentionMetadata
from tierserve.workers.kv_pool import allocate_kv_cache
from tierserve.workers.parallel import get_tp_rank, get_tp_size

TINY_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small so that, at head_dim 16, some frequencies are kept, some interpolated, some scaled.
    "original_max_position_embeddings": 64,
}


def _common(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
            num_kv_heads: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def make_tiny_llama(path: Path, *, rope_scaling: dict | None = None, vocab_size: int = 384,
                    hidden_size: int = 64, num_layers: int = 3, num_heads: int = 4,
                    num_kv_heads: int = 2, tie_word_embeddings: bool = False, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = rope_scaling or {"rope_type": "default", "rope_theta": 10000.0}
    config = LlamaConfig(**_common(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads),
                         rope_parameters=rope, tie_word_embeddings=tie_word_embeddings)
    return _save(LlamaForCausalLM, config, path, seed)


def make_tiny_qwen2(path: Path, *, vocab_size: int = 320, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    seed: int = 1) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**_common(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads),
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=True)
    return _save(Qwen2ForCausalLM, config, path, seed)


def make_tiny_qwen3(path: Path, *, vocab_size: int = 320, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    seed: int = 5) -> Path:
    """Qwen3: RMSNorm on each query and key head, no q/k/v bias, head_dim given."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**_common(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads),
                         head_dim=32, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return _save(Qwen3ForCausalLM, config, path, seed)


def make_tiny_mistral(path: Path, *, seed: int = 3, sliding_window: int | None = None) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    # head_dim 32 != hidden / heads exercises an explicit head_dim.
    config = MistralConfig(**_common(256, 64, 2, 4, 1), head_dim=32,
                           sliding_window=sliding_window,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _save(MistralForCausalLM, config, path, seed)


def make_tiny_qwen2_sliding(path: Path, *, window: int, seed: int = 4) -> Path:
    """Qwen2 with sliding-window attention in its layers from max_window_layers on."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**_common(320, 64, 3, 4, 2), use_sliding_window=True,
                         sliding_window=window, max_window_layers=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _save(Qwen2ForCausalLM, config, path, seed)


def _save(model_cls, config, path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = model_cls(config).float()
    # The default init (std 0.02) makes near-uniform logits where greedy ties are fragile;
    # larger weights give peaked distributions, and random biases make bias loading matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.12 if "embed" in name else 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """Reference logits [len(tokens), vocab] of one unpadded sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
        )
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens, "HF stopped early; the comparison needs no EOS stop"
    return tokens


@dataclass
class Work:
    """One sequence's part of a step: `tokens` at positions start .. start + len(tokens) - 1."""

    seq_id: str
    tokens: list[int]
    start: int


class PagedRunner:
    """Drives a model over a paged KV pool the way a worker would, for tests."""

    def __init__(self, model, *, num_blocks: int = 96, block_size: int = 4, seed: int = 0):
        config = model.config
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(
            config.num_hidden_layers, num_blocks, block_size, model.kv_heads_per_rank,
            config.head_dim, model.dtype, "cpu",
        )
        # Shuffled so that sequences get scattered, non-contiguous block ids.
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}

    def reserve(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow seq_id's block table to hold num_tokens tokens."""
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table

    def share_prefix(self, src: str, dst: str, num_blocks: int) -> None:
        """dst starts with src's first blocks, as a prefix-cache hit would give it."""
        self.tables[dst] = list(self.tables[src][:num_blocks])

    def step(self, works: list[Work], keep: list[int] | None = None,
             hidden: bool = False) -> list[torch.Tensor]:
        """One forward over all works (decodes must come first) -> float32 logits per work
        (with hidden, the final hidden states instead); with keep (sorted row indices of the
        step's tokens), of those rows alone, one each."""
        num_decodes = 0
        while num_decodes < len(works) and len(works[num_decodes].tokens) == 1:
            num_decodes += 1
        ids, positions, slots, tables = [], [], [], []
        for w in works:
            table = self.reserve(w.seq_id, w.start + len(w.tokens))
            tables.append(table)
            for i, tok in enumerate(w.tokens):
                pos = w.start + i
                ids.append(tok)
                positions.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        attn = AttentionMetadata.build(
            slot_mapping=slots, query_lens=[len(w.tokens) for w in works],
            seq_lens=[w.start + len(w.tokens) for w in works], block_tables=tables,
            num_decodes=num_decodes, block_size=self.block_size,
        )
        rows = None if keep is None else torch.tensor(keep, dtype=torch.int64)
        states = self.model(torch.tensor(ids), torch.tensor(positions), attn, self.kv_caches,
                            rows)
        logits = states if hidden else self.model.compute_logits(states)
        if logits is None:  # a tensor-parallel rank other than 0, which gets no logits
            return [None] * len(works)
        if keep is not None:
            return list(logits)
        return list(logits.split([len(w.tokens) for w in works]))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Batched greedy decoding: one prefill step for all prompts, then batched decode steps."""
        ids = [f"g{i}" for i in range(len(prompts))]
        tokens = _last_argmax(self.step([Work(s, p, 0) for s, p in zip(ids, prompts)]))
        outs = [[t] for t in tokens]
        for _ in range(max_new_tokens - 1):
            works = [Work(s, [o[-1]], len(p) + len(o) - 1) for s, p, o in zip(ids, prompts, outs)]
            for o, t in zip(outs, _last_argmax(self.step(works))):
                o.append(t)
        return outs


def _last_argmax(logits: list) -> list[int]:
    """Each work's token from its last row of logits. Under tensor parallelism rank 0 alone has
    logits and broadcasts the tokens, as the scheduler sends every rank the sampled tokens."""
    tokens = torch.zeros(len(logits), dtype=torch.long)
    if get_tp_rank() == 0:
        tokens = torch.stack([l[-1].argmax() for l in logits])
    if get_tp_size() > 1:
        torch.distributed.broadcast(tokens, src=0)
    return tokens.tolist()


_HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _llama_cpp_permute(w, n_head: int):
    """The row permutation llama.cpp's converter applies to llama q/k projections."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf_folder: Path, out_file: Path, *, quantize: bool | str = False) -> Path:
    """Convert a tiny HF Llama (or Qwen3) folder to a GGUF the way llama.cpp lays it out: F32,
    or with quantize (True or "q4_1") the layers' matrices Q4_1 and the embedding and output
    Q8_0 (as SmolLM2's file), or ("q8_0") every matrix Q8_0. llama.cpp permutes the q/k rows of
    llama alone."""
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    tensors = load_file(str(Path(hf_folder) / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    arch = cfg["model_type"]
    writer = gguf.GGUFWriter(str(out_file), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for name, array in tensors.items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, module = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{kind}"
            if arch == "llama" and module.endswith(("q_proj", "k_proj")):
                array = _llama_cpp_permute(array, heads if module.endswith("q_proj") else kv_heads)
        else:
            gguf_name = f"{_HF_TO_GGUF_GLOBAL[stem]}.{kind}"
        array = array.astype("float32")
        if quantize and array.ndim == 2 and array.shape[1] % 32 == 0:
            qtype = (gguf.GGMLQuantizationType.Q4_1
                     if gguf_name.startswith("blk.") and quantize in (True, "q4_1")
                     else gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_file)


_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A tiny model writes tiny words; tests read them back token for token.",
    "hello world, hello server, hello client: streaming tokens over HTTP",
] * 20


def add_tiny_tokenizer(path: Path, vocab_size: int = 384, bos: bool = False) -> Path:
    """A byte-level BPE trained here (nothing downloaded) on a few sentences, with a chat
    template, saved beside a tiny checkpoint: ids 0-2 are pad, bos, eos as in its config.
    Every string encodes (the 256 byte tokens are in the vocabulary). With `bos`, encoding
    with special tokens puts <s> first, as Llama's tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def make_lora_adapter(base: Path, path: Path, *, rank: int = 8, alpha: int = 16,
                      targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"),
                      seed: int = 0, std: float = 0.1, use_rslora: bool = False) -> Path:
    """A PEFT LoRA adapter folder for the checkpoint in `base`, saved by peft itself, with
    random A and B (a trained adapter's B is not zero) large enough to change greedy tokens."""
    from peft import LoraConfig, get_peft_model

    model = load_hf(base)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        lora_dropout=0.0, bias="none", init_lora_weights=False,
                        use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    peft_model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def load_hf_with_lora(base: Path, adapter: Path):
    """The base checkpoint with the adapter merged into its weights (PEFT's own merge)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(base), adapter).merge_and_unload().eval()
