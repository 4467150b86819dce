// A step's decoder layers in one call: per layer the same kernels, in the same order, on the
// same inputs as the model's Python path (workers/model/llama.py), so its results are bitwise
// those of that path; what goes is the ~10 Python-level op calls per layer between them.
//
// Per layer l: norm(hidden [+ residual]) -> qkv -> rotary + K/V into the pool -> paged
// attention -> o_proj -> norm(+ residual) -> gate_up -> SiLU-and-mul -> down. Returns the last
// layer's (mlp output, residual stream); the caller applies the final norm. With `keep` (int64
// row indices), the last layer projects those rows alone, as the model's path does.
//
// Linears are described by slot s = 4 l + j (j: qkv, o, gate_up, down): kinds[s] (LinearKind),
// widths[s] (output features), weights[3 s .. 3 s + 2] (the kind's tensors, unused ones None),
// biases[s]. Norm weights: norms[2 l] (input), norms[2 l + 1] (post-attention). Pools:
// kv[2 l], kv[2 l + 1]; windows[l] (0: the whole context).

namespace tierserve {
namespace {

enum LinearKind : int64_t { kPanelF32 = 0, kPanelHalf = 1, kQ8_0 = 2, kQ4_1 = 3 };

at::Tensor stack_linear(const at::Tensor& x, int64_t kind, int64_t n,
                        const c10::List<std::optional<at::Tensor>>& weights, int64_t slot,
                        const std::optional<at::Tensor>& bias) {
  const std::optional<at::Tensor> w0 = weights.get(3 * slot);
  TORCH_CHECK(w0.has_value(), "layer_stack: linear ", slot, " has no weight");
  switch (kind) {
    case kPanelF32:
      return linear_f32(x, *w0, bias, n);
    case kPanelHalf:
      return linear_half(x, *w0, bias, n);
    case kQ8_0:
      return linear_q8_0(x, *w0, *weights.get(3 * slot + 1), bias, n);
    case kQ4_1:
      return linear_q4_1(x, *w0, *weights.get(3 * slot + 1), *weights.get(3 * slot + 2), bias,
                         n);
    default:
      TORCH_CHECK(false, "layer_stack: unknown linear kind ", kind);
  }
}

std::tuple<at::Tensor, at::Tensor> layer_stack(
    const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& rows, const std::optional<at::Tensor>& keep, at::TensorList norms,
    const c10::List<std::optional<at::Tensor>>& weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef kinds,
    at::IntArrayRef widths, at::TensorList kv, at::IntArrayRef windows, int64_t heads,
    double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(layers > 0, "layer_stack: no layers");
  TORCH_CHECK(norms.size() == 2 * windows.size() && kv.size() == 2 * windows.size() &&
                  kinds.size() == 4 * windows.size() && widths.size() == kinds.size() &&
                  biases.size() == kinds.size() && weights.size() == 3 * kinds.size(),
              "layer_stack: per-layer lists disagree on the number of layers");
  at::Tensor hidden = hidden_in;
  std::optional<at::Tensor> residual;  // the first layer's norm starts the residual stream
  const int64_t tokens = hidden.size(0);
  const std::optional<at::Tensor> table_rows = rows;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t s = 4 * l;
    auto [h, r] = rms_norm(hidden, residual, norms[2 * l], eps);
    at::Tensor qkv = stack_linear(h, kinds[s], widths[s], weights, s, biases.get(s));
    auto [q, k] = rotary_write_kv(qkv, cos, sin, kv[2 * l], kv[2 * l + 1], slot_mapping, heads);
    at::Tensor att = paged_decode_attention(q, kv[2 * l], kv[2 * l + 1], block_tables, seq_lens,
                                            scale, windows[l], table_rows);
    at::Tensor att_rows = att.view({tokens, -1});
    if (keep.has_value() && l == layers - 1) {
      att_rows = att_rows.index_select(0, *keep);
      r = r.index_select(0, *keep);
    }
    at::Tensor o = stack_linear(att_rows, kinds[s + 1], widths[s + 1], weights, s + 1,
                                biases.get(s + 1));
    auto [h2, r2] = rms_norm(o, r, norms[2 * l + 1], eps);
    at::Tensor gate_up = stack_linear(h2, kinds[s + 2], widths[s + 2], weights, s + 2,
                                      biases.get(s + 2));
    hidden = stack_linear(silu_and_mul(gate_up), kinds[s + 3], widths[s + 3], weights, s + 3,
                          biases.get(s + 3));
    residual = r2;
  }
  return {hidden, *residual};
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("layer_stack(Tensor hidden, Tensor cos, Tensor sin, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor rows, Tensor? keep, "
        "Tensor[] norms, "
        "Tensor?[] weights, Tensor?[] biases, int[] kinds, int[] widths, Tensor(a!)[] kv, "
        "int[] windows, int heads, float scale, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("layer_stack", &tierserve::layer_stack);
}
