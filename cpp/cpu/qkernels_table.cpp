// cpu: which quantized kernels an ISA level gets (the f32-dequant table and the int8-activation
// panel kernel with its activation quantizer), from the CPU probe.
#include "common/check.h"
#include "cpu/cpu_features.h"
#include "cpu/qkernels.h"

namespace fantai::cpu {

bool cpu_has_avx512_vnni() { return cpu_features().avx512_vnni && avx512_vnni_linear_panel() != nullptr; }

PanelKernels panel_kernels_for(Isa isa) {
  FANTAI_REQUIRE(static_cast<int>(isa) <= static_cast<int>(detected_isa()),
                 "cpu: ISA level " << isa_name(isa) << " is not supported by this CPU");
  if (isa == Isa::kAvx512 && cpu_has_avx512_vnni()) {
    const QuantizeRowsFn q = avx512_quantize_rows_int8();
    return {"vnni", avx512_vnni_linear_panel(), q ? q : quantize_rows_int8, 4};
  }
  if (isa == Isa::kAvx2 && avx_vnni_panels() && avx_vnni_linear_panel()) {
    const QuantizeRowsFn q = avx2_quantize_rows_int8();
    return {"avxvnni", avx_vnni_linear_panel(), q ? q : quantize_rows_int8, 2};
  }
  // AVX-512 without VNNI (Skylake-X, Cascade Lake before it was added) runs the AVX2 kernel.
  if (isa != Isa::kScalar && avx2_linear_panel()) {
    const QuantizeRowsFn q = avx2_quantize_rows_int8();
    return {"avx2", avx2_linear_panel(), q ? q : quantize_rows_int8, 2};
  }
  return {"scalar", scalar_linear_panel(), quantize_rows_int8, 1};
}

const QKernelTable& qkernels_for(Isa isa) {
  FANTAI_REQUIRE(static_cast<int>(isa) <= static_cast<int>(detected_isa()),
                 "cpu: ISA level " << isa_name(isa) << " is not supported by this CPU");
  const QKernelTable* t = isa == Isa::kAvx512 ? avx512_qkernels()
                          : isa == Isa::kAvx2 ? avx2_qkernels()
                                              : scalar_qkernels();
  FANTAI_REQUIRE(t != nullptr, "cpu: quantized kernels for " << isa_name(isa) << " were not built");
  return *t;
}

}  // namespace fantai::cpu
