"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV pool, built from TP
layers.

Module names mirror Hugging Face's, except the fused `qkv_proj` and `gate_up_proj`, so
`load_weights` maps checkpoint names with a small table.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tierserve.workers.attention import AttentionMetadata
from tierserve.workers.backends.base import Backend
from tierserve.workers.backends.portable import torch_backend
from tierserve.workers.backends.stack import StackLayer
from tierserve.workers.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    copy_checked,
    pack_weights,
    partition_heads,
)
from tierserve.workers.model.config import ModelConfig
from tierserve.workers.model.lora import LoRAStep
from tierserve.workers.parallel import get_tp_size

KVCache = tuple[torch.Tensor, torch.Tensor]

# HF projection name -> (fused module name, shard id inside it)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _shards_of(param_name: str) -> tuple:
    """Shard ids a parameter is loaded in: one per fused HF projection, else (None,)."""
    module = param_name.split(".")[-2]
    shards = tuple(shard for fused, shard in _FUSED.values() if fused == module)
    return shards or (None,)


def _storage_key(t: torch.Tensor) -> int:
    """What identifies a tensor's memory: its data pointer, or for an opaque tensor (oneDNN's
    packed weights) the tensor itself."""
    return id(t) if t.is_mkldnn else t.data_ptr()


def _bytes_once(tensors: list[torch.Tensor]) -> int:
    """The tensors' bytes, each memory counted once (a tied head's weight is the embedding's)."""
    return sum({_storage_key(t): t.numel() * t.element_size()
                for t in tensors if t.numel()}.values())


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, device,
                 backend: Backend, window: int | None = None):
        super().__init__()
        self.backend = backend
        self.window = window  # sliding window of this layer, None for full attention
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads,
            config.num_key_value_heads, config.attention_bias, dtype, device,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size,
            config.attention_output_bias, dtype, device,
        )
        self.rotary = rotary
        if config.qk_norm:  # one weight [D] over every head (replicated across ranks)
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(config.head_dim, eps, dtype, device, backend)
            self.k_norm = RMSNorm(config.head_dim, eps, dtype, device, backend)

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each query and key head RMS-normed (Qwen3), V as it is."""
        t, d = qkv.shape[0], self.head_dim
        q_end, k_end = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
        q = self.q_norm(qkv[:, :q_end].reshape(-1, d)).view(t, q_end)
        k = self.k_norm(qkv[:, q_end:k_end].reshape(-1, d)).view(t, k_end - q_end)
        return torch.cat([q, k, qkv[:, k_end:]], dim=1)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, attn: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden], or [len(keep), hidden]: every token's K/V is written,
        and only the kept tokens' outputs are projected."""
        qkv = self.qkv_proj(hidden)  # [T, (heads + 2 * kv_heads) * D]
        if hasattr(self, "q_norm"):
            qkv = self._norm_heads(qkv)
        q, k, v = self.backend.rotary_write_kv(qkv, cos, sin, kv_cache, attn.slot_mapping,
                                               self.num_heads, self.num_kv_heads, self.head_dim)
        out = self.backend.attention(q, k, v, kv_cache, attn, self.scale, self.window)
        if keep is not None:
            out = out.index_select(0, keep)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, backend: Backend):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], config.mlp_bias, dtype, device
        )
        self.act = SiluAndMul(backend)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, device,
                 backend: Backend, layer: int = 0):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, backend)
        self.self_attn = LlamaAttention(config, rotary, dtype, device, backend,
                                        config.window_of(layer))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, backend)
        self.mlp = LlamaMLP(config, dtype, device, backend)

    def forward(self, hidden, residual, cos, sin, kv_cache: KVCache, attn: AttentionMetadata,
                keep: torch.Tensor | None = None):
        """Returns (mlp output, residual stream); the caller adds them (fused into the next norm).
        With keep, of those rows only (the layer still writes every token's K/V)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, attn, keep)
        if keep is not None:
            residual = residual.index_select(0, keep)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def stack_layer(self) -> StackLayer | None:
        """The layer in plain values for a backend's layer stack; None before its linears
        have their methods (backends/stack.py)."""
        attn, mlp = self.self_attn, self.mlp
        linears = tuple((m.method, m.bias) for m in (attn.qkv_proj, attn.o_proj,
                                                      mlp.gate_up_proj, mlp.down_proj))
        if any(method is None for method, _ in linears):
            return None
        qk = (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else None
        return StackLayer(self.input_layernorm.weight, self.post_attention_layernorm.weight,
                          linears, attn.window, qk)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, backend: Backend):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device)
        # One rotary table for all layers; its inv_freq stays float32 like HF's.
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling_dict, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, dtype, device, backend, i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, backend)
        self.config, self.dtype, self.backend = config, dtype, backend
        # The backend's one-call route through the layers (None: it has none), built on the
        # first forward after the weights are packed. False turns it off (tests compare).
        self.use_layer_stack = True
        self.lora: LoRAStep | None = None  # the step's adapters, where LoRA is enabled
        self._linears: list | None = None
        self._stack: object | None = None
        self._stack_built = False

    def _projections(self) -> list:
        """Every layer's linears in the layer stack's order."""
        if self._linears is None:
            self._linears = [m for layer in self.layers for m in (
                layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj)]
        return self._linears

    def layer_stack(self):
        """The backend's route for a step's layers in one call, or None (backends/stack.py)."""
        if not self.use_layer_stack or get_tp_size() != 1:
            return None
        if not self._stack_built:
            layers = [layer.stack_layer() for layer in self.layers]
            if any(layer is None for layer in layers):
                return None  # not packed yet
            attn = self.layers[0].self_attn
            self._stack = self.backend.layer_stack(layers, attn.num_heads, attn.head_dim,
                                                   attn.scale, self.config.rms_norm_eps,
                                                   self.dtype)
            self._stack_built = True
        return self._stack

    def forward(self, input_ids, positions, attn: AttentionMetadata, kv_caches: list[KVCache],
                keep: torch.Tensor | None = None):
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)  # [T, D / 2] each
        lora = self.lora if self.lora is not None and self.lora.active else None
        stack = self.layer_stack()
        out = None if stack is None else stack.run(
            hidden, cos, sin, kv_caches, attn, keep,
            None if lora is None else lora.stack(self._projections()))
        if out is not None:
            return self.norm(*out)[0]
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            # Only the kept rows' final states are read, and after the last attention no row
            # mixes with another: the last layer projects those rows alone.
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn,
                                     keep if i == last else None)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 backend: Backend | None = None, quantization: str | None = None):
        super().__init__()
        # Fails early, with the reason, when the head counts cannot be split at this TP size.
        partition_heads(config.num_attention_heads, config.num_key_value_heads, get_tp_size())
        self.config = config
        self.dtype = dtype
        # The kernels every layer runs with, fixed for the model's life.
        self.backend = backend or torch_backend()
        # Block format the linears are quantized to at load (backends/quant.py), or None.
        self.quantization = quantization
        self.model = LlamaModel(config, dtype, device, self.backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds: every parameter still held and every linear's
        method (codes, panels, packed copies, a greedy head's copy), each tensor once."""
        held = [p for p in self.parameters()]
        for m in self.modules():
            for route in (getattr(m, "method", None), getattr(m, "greedy_head", None)):
                if route is not None:
                    held += route.tensors()
        return _bytes_once(held)

    def decode_weight_bytes(self) -> int:
        """Bytes of weights a greedy single-sequence decode step reads on this rank: each
        decoder linear's single-row route (LinearMethod.row_tensors) with its bias, the norms,
        and the head's greedy route where it has one (else its product's); not the embedding
        table, of which a step reads one row."""
        read: list[torch.Tensor] = []
        for m in [*self.model.layers.modules(), self.model.norm]:
            read += [p for p in m.parameters(recurse=False) if p is not None]
            if getattr(m, "method", None) is not None:
                read += m.method.row_tensors()
        head = self.lm_head
        if head.greedy_head is not None:
            read += head.greedy_head.row_tensors()
        else:
            read += head.method.row_tensors() if head.method is not None else [head.weight]
        return _bytes_once(read)

    def enable_lora(self) -> LoRAStep:
        """Gives every decoder projection the model's LoRAStep, which the model runner fills
        with the adapters of each step."""
        step = self.model.lora = LoRAStep(self.backend)
        for module in self.model._projections():
            module.lora = step
        return step

    def lora_target(self, layer: int, proj: str):
        """(module, shard id) of Hugging Face projection `proj` of decoder layer `layer`."""
        fused, shard = _FUSED.get(proj, (proj, None))
        block = self.model.layers[layer]
        owner = block.self_attn if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp
        return getattr(owner, fused), shard

    @property
    def kv_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[KVCache], keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size], or of the rows
        in keep ([n] int64, non-empty) alone, [n, hidden_size]: a prefill's other tokens
        then skip the last layer's output projection and MLP."""
        return self.model(input_ids, positions, attn, kv_caches, keep)

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden_size] -> long[n], the first index of each row's maximum logit, where the
        LM head has a route that skips the full logits (layers.GreedyHead); else None."""
        return self.lm_head.greedy(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden_size] -> float32 logits [n, vocab_size] on TP rank 0, the rank that
        samples; None on the others (a collective: every rank calls it)."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face named tensors; each layer keeps only this rank's shard.

        Raises ValueError on unknown names and on parameters the checkpoint never provided.
        The weights then take the layout the backend's linears run (quantized where the model
        was built with a quantization).
        """
        params = dict(self.named_parameters())
        pending = {(name, shard) for name in params for shard in _shards_of(name)}
        for hf_name, tensor in named_tensors:
            key = self._load_one(params, hf_name, tensor)
            if key is not None:
                pending.discard(key)
        if pending:
            missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in pending)
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
        pack_weights(self, self.backend, self.quantization)

    def _load_one(self, params: dict, hf_name: str, tensor: torch.Tensor):
        """Load one HF tensor; returns the (param name, shard id) it filled, or None if skipped."""
        if "rotary_emb." in hf_name:
            return None
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # the head is the embedding; some checkpoints store a copy anyway
        parts = hf_name.split(".")
        shard_id = None
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard_id = _FUSED[parts[-2]]
            parts[-2] = fused
        name = ".".join(parts)
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected checkpoint tensor {hf_name!r} for {self.config.architecture}")
        loader = getattr(param, "weight_loader", None)
        try:
            if shard_id is not None:
                loader(param, tensor, shard_id)
            elif loader is not None:
                loader(param, tensor)
            else:
                copy_checked(param.data, tensor)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"cannot load checkpoint tensor {hf_name!r}: {exc}") from exc
        return name, shard_id
