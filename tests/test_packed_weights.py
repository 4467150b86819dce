"""oneDNN-packed bf16/fp16 weights: the same results as F.linear, attached only where they apply."""
import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import make_tiny_llama
from tierserve.workers.layers import (
    ColumnParallelLinear, PackedWeight, ParallelLMHead, RowParallelLinear,
)
from tierserve.workers.loader import load_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(dtype, m):
    torch.manual_seed(m)
    w, x, b = torch.randn(96, 80, dtype=dtype), torch.randn(m, 80, dtype=dtype), torch.randn(96, dtype=dtype)
    got = PackedWeight(w).linear(x, b).float()
    want = F.linear(x.float(), w.float(), b.float())
    # both round once to the output dtype; allow that rounding only
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)
    assert torch.allclose(got, F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)


def test_pack_weights_covers_every_linear_of_a_bf16_model_and_no_fp32_one(tmp_path):
    path = make_tiny_llama(tmp_path / "llama")
    linears = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    _, bf16 = load_model(str(path), torch.bfloat16)
    _, fp32 = load_model(str(path), torch.float32)
    assert all(m.packed is not None for m in bf16.modules() if isinstance(m, linears))
    assert all(m.packed is None for m in fp32.modules() if isinstance(m, linears))
