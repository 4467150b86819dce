"""The model hyper-parameters the runtime needs, independent of checkpoint format."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


def _freeze(value: Any) -> Any:
    """Make nested lists/dicts hashable so the config stays a frozen, hashable value."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Sorted (key, value) items of the HF rope scaling dict (without rope_theta); None = plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama's attention_bias)
    attention_output_bias: bool = False  # bias on o_proj (Llama's attention_bias only)
    mlp_bias: bool = False
    # RMSNorm of each query and key head before RoPE (Qwen3).
    qk_norm: bool = False
    # Sliding-window attention: a token sees the last sliding_window tokens of its context, in
    # every layer, or (layer_types given) in the layers marked "sliding_attention" only.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _rope_from_hf(cfg)
        llama_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else llama_bias,
            qk_norm=arch == "qwen3",
            attention_output_bias=llama_bias if arch == "llama" else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if arch == "llama" else False,
            sliding_window=_sliding_window(arch, cfg),
            layer_types=tuple(cfg["layer_types"]) if cfg.get("layer_types") else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
        )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, frozen scaling) from either `rope_parameters` (v5) or `rope_scaling` (v4)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, _freeze(params)


def _sliding_window(arch: str, cfg: Mapping[str, Any]) -> int | None:
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def valid_tp_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """The TP sizes a model's heads split over: dividing the query heads, and dividing the KV
    heads or a multiple of them."""
    return [t for t in range(1, num_heads + 1)
            if num_heads % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)]


def partition_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) held by one rank.

    KV heads split evenly when tp_size divides them; when tp_size is a multiple of them each
    rank holds one KV head, replicated across tp_size // num_kv_heads neighbouring ranks.
    """
    valid = ", ".join(map(str, valid_tp_sizes(num_heads, num_kv_heads)))
    if num_heads % tp_size:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be divisible by the TP size ({tp_size}); "
            f"tensor_parallel_size for this model: {valid}"
        )
    if num_kv_heads % tp_size == 0:
        return num_heads // tp_size, num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return num_heads // tp_size, 1
    raise ValueError(
        f"num_key_value_heads ({num_kv_heads}) must divide, or be divisible by, the TP size "
        f"({tp_size}); tensor_parallel_size for this model: {valid}"
    )
