// cpu: the AVX2 panel kernels' linear with AVX-VNNI (VEX vpdpbusd on YMM), for CPUs that have it
// without AVX-512: Alder Lake and later clients, the E-core Xeons (Sierra Forest). The u8 weights
// multiply the int8 activations directly, four pairs into each int32 lane, so Q8_0 needs neither
// the sign trick nor vpmaddwd, and the 4-bit steps no int16 sums. The code is
// qkernels_panel_avx2_impl.h's; only its multiply-accumulate differs (see there), and every
// integer sum is exact, so a row gets the AVX2, AVX-512 VNNI and portable kernels' bits.
#include <cstdint>
#include <cstring>

#include "cpu/qkernels.h"
// Last: the rest of this file is AVX2 + AVX-VNNI code (see vt_avx2.h).
#include "cpu/vt_avx2.h"

#if defined(FANTAI_VT_AVX2) && defined(__AVXVNNI__)
#define FANTAI_PANEL_AVX_VNNI 1
namespace fantai::cpu {
namespace {

#define FV_INLINE inline __attribute__((always_inline))

#include "cpu/qkernels_panel_avx2_impl.h"

#undef FV_INLINE

}  // namespace

LinearPanelFn avx_vnni_linear_panel() { return linear_panel; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
LinearPanelFn avx_vnni_linear_panel() { return nullptr; }
}  // namespace fantai::cpu
#endif
