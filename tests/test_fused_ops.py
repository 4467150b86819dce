"""The fused C++ elementwise ops (csrc/fused.cpp) against the torch formulation they replace:
RMSNorm with and without the residual add, SiLU-and-mul, and RoPE with the KV-pool write."""
from __future__ import annotations

import pytest
import torch

from tierserve.workers.attention import write_kv
from tierserve.workers.backends.portable import torch_backend
from tierserve.workers.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul


# fp32: the RMS sum's order and exp's last ulp differ from torch's; bf16 rounds them away here.
TOL = {torch.float32: dict(rtol=1e-6, atol=2e-6), torch.bfloat16: dict(rtol=0, atol=0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 40])  # whole vectors, and a partial last one
def test_rms_norm_and_silu_match_torch(kernels, dtype, width):
    g = torch.Generator().manual_seed(width)
    norm = RMSNorm(width, 1e-5, dtype, "cpu", kernels)
    plain = RMSNorm(width, 1e-5, dtype, "cpu", torch_backend())
    norm.weight.data.copy_(torch.randn(width, generator=g))
    plain.weight.data.copy_(norm.weight.data)
    x = torch.randn(37, width, generator=g).to(dtype)
    residual = torch.randn(37, width, generator=g).to(dtype)
    gate_up = (4 * torch.randn(37, 2 * width, generator=g)).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, -30.0, 0.0, 30.0, 100.0, -0.0])  # exp's saturation

    out, summed = norm(x, residual)
    want_out, want_summed = plain(x, residual)
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(norm(x), plain(x), **TOL[dtype])
    torch.testing.assert_close(SiluAndMul(kernels)(gate_up), SiluAndMul(torch_backend())(gate_up),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (16, 4, 2)])
def test_rotary_write_kv_equals_torch_bitwise(kernels, dtype, head_dim, heads, kv_heads):
    g = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 10000.0, None, "cpu")
    tokens = 21
    cos, sin = rotary.cos_sin(torch.arange(tokens) * 37, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    slots = torch.randperm(40, generator=g)[:tokens]
    pools = [torch.zeros(10, 4, kv_heads, head_dim, dtype=dtype) for _ in range(4)]

    q, k, v = kernels.rotary_write_kv(qkv, cos, sin, (pools[0], pools[1]), slots, heads,
                                      kv_heads, head_dim)
    qk = rotary.apply(qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, -1),
                      cos, sin)
    v_ref = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    write_kv(pools[2], pools[3], qk[:, heads:], v_ref, slots)
    assert torch.equal(q, qk[:, :heads]) and torch.equal(k, qk[:, heads:])
    assert torch.equal(v, v_ref)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


def test_rotary_write_kv_rejects_slots_outside_the_pool(kernels):
    qkv = torch.randn(2, 3 * 16)
    cos = sin = torch.ones(2, 8)
    pool = torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.rotary_write_kv(qkv, cos, sin, (pool, pool.clone()), torch.tensor([0, 8]), 1, 1,
                                16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 4099, 49152])
def test_argmax_rows_matches_torch_max_indices(kernels, dtype, width):
    """Ties (values 0..4), NaNs, all -inf rows and rows strided wider than their width: the
    first index of the maximum, NaN first, exactly as max(dim).indices (and argmax)."""
    g = torch.Generator().manual_seed(width)
    wide = torch.randint(0, 5, (9, width + 3), generator=g).to(dtype)
    x = wide[:, :width]  # rows 3 values apart
    x[1] = float("-inf")
    x[2, width // 2] = float("nan")
    x[3, [0, width - 1]] = float("nan")
    x[4] = float("nan")
    x[5, -1] = 7.0  # the maximum in the scalar tail
    got = kernels.argmax_rows(x)
    assert got.dtype == torch.long and got.shape == (9,)
    assert torch.equal(got, x.max(dim=-1).indices)
    assert torch.equal(got, x.float().argmax(dim=-1))


def test_argmax_rows_rejects_bad_inputs(kernels):
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.ops.argmax_rows(torch.zeros(4, 0))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.ops.argmax_rows(torch.zeros(4, 8).t())
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.ops.argmax_rows(torch.zeros(4, 8, dtype=torch.float64))
