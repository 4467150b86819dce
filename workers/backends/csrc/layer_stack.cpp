// A step's decoder layers in one call: per layer the same kernels, in the same order, on the
// same inputs as the model's Python path (workers/model/llama.py), so its results are bitwise
// those of that path; what goes is the ~10 Python-level op calls per layer between them, and
// each op's allocation of its output (StackBuffers).
//
// Per layer l: norm(hidden [+ residual]) -> qkv -> rotary + K/V into the pool -> paged
// attention -> o_proj -> norm(+ residual) -> gate_up -> SiLU-and-mul -> down. Returns the last
// layer's (mlp output, residual stream); the caller applies the final norm. With `keep` (int64
// row indices), the last layer projects those rows alone, as the model's path does.
//
// Linears are described by slot s = 4 l + j (j: qkv, o, gate_up, down): kinds[s] (LinearKind),
// widths[s] (output features), weights[3 s .. 3 s + 2] (the kind's tensors, unused ones None),
// biases[s]; with LoRA adapters, lora[5 s .. 5 s + 4] the a_t, b_t, offsets and column
// masks (of the step's tokens, of the kept rows) of the step's adapters on that linear
// (lora.cpp; None where none has one; offsets and masks None for a lone adapter on every
// row), and lora_rows / lora_kept_rows each row's adapter, of the step's tokens and of the
// kept rows (an empty list: no adapter). Norm weights: norms[2 l] (input), norms[2 l + 1] (post-attention); with
// per-head query and key norms (Qwen3), qk_norms[2 l] and qk_norms[2 l + 1] (else empty), as
// the model's path applies them: each head of qkv's q and k parts, gathered, RMS-normed, put
// back. Pools: kv[2 l], kv[2 l + 1]; windows[l] (0: the whole context).

namespace tierserve {
namespace {

enum LinearKind : int64_t {
  kPanelF32 = 0, kPanelHalf = 1, kQ8_0 = 2, kQ4_1 = 3, kCodedF32 = 4, kCodedPairs = 5,
  kInt8 = 6
};

// Kinds whose kernels take fp32 rows alone (the GGUF codes' chains and the int8 linears).
bool fp32_rows_only(int64_t kind) { return kind == kQ8_0 || kind == kQ4_1 || kind == kInt8; }

void stack_linear(const at::Tensor& x, int64_t kind, int64_t n,
                  const c10::List<std::optional<at::Tensor>>& weights, int64_t slot,
                  const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const std::optional<at::Tensor> w0 = weights.get(3 * slot);
  TORCH_CHECK(w0.has_value(), "layer_stack: linear ", slot, " has no weight");
  if (x.scalar_type() != at::kFloat && fp32_rows_only(kind)) {
    // As the model's path runs them (linear.py's run_fp32): rows and bias widened, the product
    // in fp32, rounded once to the stack's dtype.
    at::Tensor wide = at::empty(out.sizes(), out.options().dtype(at::kFloat));
    const std::optional<at::Tensor> wide_bias =
        bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
    stack_linear(x.to(at::kFloat).contiguous(), kind, n, weights, slot, wide_bias, wide);
    out.copy_(wide);
    return;
  }
  switch (kind) {
    case kPanelF32:
      return linear_f32_into(x, *w0, bias, n, out);
    case kPanelHalf:
      return linear_half_into(x, *w0, bias, n, out);
    case kQ8_0:
      return quant_linear_into("linear_q8_0: ", false, x, *w0, *weights.get(3 * slot + 1),
                               *weights.get(3 * slot + 1), bias, n, out);
    case kQ4_1:
      return quant_linear_into("linear_q4_1: ", true, x, *w0, *weights.get(3 * slot + 1),
                               *weights.get(3 * slot + 2), bias, n, out);
    case kCodedF32:
      return linear_coded_into(x, *w0, *weights.get(3 * slot + 1), *weights.get(3 * slot + 2),
                               bias, n, out);
    case kCodedPairs:
      return linear_coded_pairs_into(x, *w0, *weights.get(3 * slot + 1),
                                     *weights.get(3 * slot + 2), bias, n, out);
    case kInt8:
      return linear_int8_into(x, *w0, bias, n, out);
    default:
      TORCH_CHECK(false, "layer_stack: unknown linear kind ", kind);
  }
}

// The activations a call's layers write, each a buffer of its own.
enum Buffer : int {
  kNormed, kResidualA, kResidualB, kQkv, kQ, kK, kAttention, kO, kGateUp, kAct, kHidden, kBuffers
};

// A call's activations, allocated once and rewritten by every layer (with a step's few rows,
// allocations are a visible share of an op's time). Each buffer holds `tokens` rows of the
// widest width asked of it; the residual stream alternates between two (ResidualStream).
class StackBuffers {
 public:
  StackBuffers(int64_t tokens, const at::TensorOptions& options)
      : tokens_(tokens), options_(options) {}

  // Buffer `which` as a contiguous [rows, width] tensor (rows <= tokens), the view made again
  // only when the shape changes.
  at::Tensor& view(Buffer which, int64_t rows, int64_t width) {
    Slot& s = slots_[which];
    if (!s.flat.defined() || s.flat.numel() < tokens_ * width)
      s.flat = at::empty({tokens_ * width}, options_);
    if (!s.view.defined() || s.view.size(0) != rows || s.view.size(1) != width)
      s.view = s.flat.narrow(0, 0, rows * width).view({rows, width});
    return s.view;
  }

 private:
  struct Slot {
    at::Tensor flat, view;
  };
  int64_t tokens_;
  at::TensorOptions options_;
  Slot slots_[kBuffers];
};

// The residual stream: the first layer's norm starts it (as the layer's input itself); each
// norm after that writes x + residual into the buffer the stream is not in.
class ResidualStream {
 public:
  // norm(x [+ residual]) into the kNormed buffer, which it returns; the stream moves on.
  at::Tensor norm(StackBuffers& buf, const at::Tensor& x, const at::Tensor& w, double eps) {
    at::Tensor& out = buf.view(kNormed, x.size(0), x.size(1));
    at::Tensor& res = buf.view(next_, x.size(0), x.size(1));
    stream_ = rms_norm_into(x, stream_, w, eps, out, res);
    if (stream_->is_same(res)) next_ = next_ == kResidualA ? kResidualB : kResidualA;
    return out;
  }
  // Keeps the rows `keep` alone (the last layer's projected rows).
  void select(const at::Tensor& keep) { stream_ = stream_->index_select(0, keep); }
  const at::Tensor& tensor() const { return *stream_; }

 private:
  std::optional<at::Tensor> stream_;
  Buffer next_ = kResidualA;
};

// Each `count`-wide head of qkv's columns [first, first + count * d) RMS-normed by w.
void norm_heads(at::Tensor& qkv, int64_t first, int64_t count, int64_t d, const at::Tensor& w,
                double eps) {
  at::Tensor part = qkv.narrow(1, first, count * d);
  const at::Tensor heads = part.reshape({-1, d});  // a copy: the rows of a head each
  at::Tensor normed = at::empty_like(heads), unused;
  rms_norm_into(heads, std::nullopt, w, eps, normed, unused);
  part.copy_(normed.view({qkv.size(0), count * d}));
}

void check_stack(const at::Tensor& hidden, at::TensorList norms, at::TensorList qk_norms,
                 const c10::List<std::optional<at::Tensor>>& weights,
                 const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef kinds,
                 at::IntArrayRef widths, at::TensorList kv, at::IntArrayRef windows) {
  TORCH_CHECK(!windows.empty(), "layer_stack: no layers");
  TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2 * windows.size(),
              "layer_stack: qk_norms must be empty or two a layer");
  TORCH_CHECK(norms.size() == 2 * windows.size() && kv.size() == 2 * windows.size() &&
                  kinds.size() == 4 * windows.size() && widths.size() == kinds.size() &&
                  biases.size() == kinds.size() && weights.size() == 3 * kinds.size(),
              "layer_stack: per-layer lists disagree on the number of layers");
  TORCH_CHECK(hidden.dim() == 2 && kv[0].dim() == 4, "layer_stack: hidden must be [T, H] and "
              "the pools [blocks, block_size, kv_heads, D]");
}

std::tuple<at::Tensor, at::Tensor> layer_stack(
    const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& rows, const std::optional<at::Tensor>& keep, at::TensorList norms,
    at::TensorList qk_norms, const c10::List<std::optional<at::Tensor>>& weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef kinds,
    at::IntArrayRef widths, const c10::List<std::optional<at::Tensor>>& lora,
    const std::optional<at::Tensor>& lora_rows, const std::optional<at::Tensor>& lora_kept_rows,
    at::TensorList kv, at::IntArrayRef windows, int64_t heads, double scale, double eps) {
  check_stack(hidden_in, norms, qk_norms, weights, biases, kinds, widths, kv, windows);
  TORCH_CHECK(lora.empty() || lora.size() == 5 * kinds.size(),
              "layer_stack: lora must be empty or five a linear");
  const int64_t step_tokens = hidden_in.size(0);
  // Each linear, then its adapters' delta where they have one.
  auto project = [&](const at::Tensor& x, int64_t slot, at::Tensor& out) {
    stack_linear(x, kinds[slot], widths[slot], weights, slot, biases.get(slot), out);
    if (lora.empty()) return;
    const std::optional<at::Tensor> a_t = lora.get(5 * slot);
    if (!a_t.has_value()) return;
    const std::optional<at::Tensor> offsets = lora.get(5 * slot + 2);
    const bool full = x.size(0) == step_tokens;
    lora_add_into(x, *a_t, *lora.get(5 * slot + 1), offsets,
                  !offsets.has_value() ? std::nullopt : full ? lora_rows : lora_kept_rows,
                  lora.get(5 * slot + (full ? 3 : 4)), out);
  };
  const int64_t layers = static_cast<int64_t>(windows.size()), tokens = hidden_in.size(0);
  const int64_t kv_heads = kv[0].size(2), d = kv[0].size(3);
  StackBuffers buf(tokens, hidden_in.options());
  ResidualStream residual;
  at::Tensor hidden = hidden_in;
  const std::optional<at::Tensor> table_rows = rows;
  // Every layer's rotary and attention outputs have the same shapes: one view each.
  at::Tensor q = buf.view(kQ, tokens, heads * d).view({tokens, heads, d});
  at::Tensor k = buf.view(kK, tokens, kv_heads * d);
  const at::Tensor att_rows = buf.view(kAttention, tokens, heads * d);
  at::Tensor att_heads = att_rows.view({tokens, heads, d});
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t s = 4 * l;
    const at::Tensor h = residual.norm(buf, hidden, norms[2 * l], eps);
    at::Tensor& qkv = buf.view(kQkv, tokens, widths[s]);
    project(h, s, qkv);
    if (!qk_norms.empty()) {
      norm_heads(qkv, 0, heads, d, qk_norms[2 * l], eps);
      norm_heads(qkv, heads * d, kv_heads, d, qk_norms[2 * l + 1], eps);
    }
    rotary_write_kv_into(qkv, cos, sin, kv[2 * l], kv[2 * l + 1], slot_mapping, heads, q, k);
    paged_decode_attention_into(q, kv[2 * l], kv[2 * l + 1], block_tables, seq_lens, scale,
                                windows[l], table_rows, att_heads);
    at::Tensor att = att_rows;
    if (keep.has_value() && l == layers - 1) {
      att = att.index_select(0, *keep);
      residual.select(*keep);
    }
    const int64_t out_rows = att.size(0);
    at::Tensor& o = buf.view(kO, out_rows, widths[s + 1]);
    project(att, s + 1, o);
    const at::Tensor h2 = residual.norm(buf, o, norms[2 * l + 1], eps);
    at::Tensor& gate_up = buf.view(kGateUp, out_rows, widths[s + 2]);
    project(h2, s + 2, gate_up);
    at::Tensor& act = buf.view(kAct, out_rows, widths[s + 2] / 2);
    silu_and_mul_into(gate_up, act);
    at::Tensor& down = buf.view(kHidden, out_rows, widths[s + 3]);
    project(act, s + 3, down);
    hidden = down;
  }
  return {hidden, residual.tensor()};
}

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("layer_stack(Tensor hidden, Tensor cos, Tensor sin, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor rows, Tensor? keep, "
        "Tensor[] norms, Tensor[] qk_norms, "
        "Tensor?[] weights, Tensor?[] biases, int[] kinds, int[] widths, Tensor?[] lora, "
        "Tensor? lora_rows, Tensor? lora_kept_rows, Tensor(a!)[] kv, "
        "int[] windows, int heads, float scale, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(TIERSERVE_OPS, CPU, m) {
  m.impl("layer_stack", &tierserve::layer_stack);
}
