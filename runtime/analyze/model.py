"""What the analysis needs of a model: one KV block's bytes per rank. Reads the model's config
through the workers' loader (which imports torch), only when asked."""
from __future__ import annotations

__all__ = ["kv_block_bytes", "DTYPE_BYTES"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_block_bytes(model: str, dtype: str, tensor_parallel_size: int,
                   block_size: int) -> tuple[int, int]:
    """(bytes of one block id on one rank, all layers, K and V: what the engine's workers
    allocate and a CPU slot holds; the distinct KV-head ranges over the ranks: an SSD block is
    an entry of each)."""
    if dtype == "auto":
        dtype = "float32"  # the CPU engine's default; pass --dtype for a GPU deployment
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    from tierserve.workers.model.layers import partition_heads
    from tierserve.workers.model.loader import load_model_config
    try:
        config = load_model_config(model)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"model: cannot read the config of {model!r}: {e}") from None
    _, kv_heads = partition_heads(config.num_attention_heads, config.num_key_value_heads,
                                  tensor_parallel_size)
    ranges = min(tensor_parallel_size, config.num_key_value_heads)
    return (2 * config.num_hidden_layers * block_size * kv_heads * config.head_dim
            * DTYPE_BYTES[dtype], ranges)
