// Every CPU kernel in one translation unit: parsing torch's headers is most of a build's time,
// and one parse then serves all the sources. kernels.py compiles this file once per ISA variant,
// with TIERSERVE_OPS naming the variant's op namespace and TIERSERVE_ISA its ISA.

#include "paged_attention.cpp"
#include "prefill_attention.cpp"
#include "linear_pairs.cpp"
#include "linear.cpp"
#include "linear_coded.cpp"
#include "coded_encode.cpp"
#include "linear_coded_pairs.cpp"
#include "linear_amx.cpp"
#include "greedy_head.cpp"
#include "int8_head.cpp"
#include "int8_greedy.cpp"
#include "fused.cpp"
#include "quant.cpp"
#include "quant_encode.cpp"
#include "linear_int8.cpp"
#include "lora.cpp"
#include "layer_stack.cpp"

#include <string>

#ifndef TIERSERVE_ISA
#define TIERSERVE_ISA native
#endif

namespace tierserve {
namespace {

std::string build_isa() { return TIERSERVE_STR(TIERSERVE_ISA); }

int64_t vector_lanes() { return kLanes; }

}  // namespace
}  // namespace tierserve

TORCH_LIBRARY_FRAGMENT(TIERSERVE_OPS, m) {
  m.def("build_isa() -> str", &tierserve::build_isa);
  m.def("vector_lanes() -> int", &tierserve::vector_lanes);
  m.def("panel_width() -> int", []() -> int64_t { return tierserve::kPanel; });
}
