// cpu: the row kernels: RMSNorm (with the residual add), RoPE, SiLU-mul, add, dtype to f32, written once over VT; included by kernels_impl.h inside each ISA's
// namespace (see there for the rules: no #include, no std:: templates, batch invariance).
#pragma once

// ---- row ops -----------------------------------------------------------------------------------

FT_INLINE void scale_store(const float* x, const float* w, float* out, int64_t dim, float inv) {
  const V s = VT::set1(inv);
  const int64_t dv = dim - dim % W;
  for (int64_t i = 0; i < dv; i += W)
    VT::store(out + i, VT::mul(VT::mul(VT::load(x + i), s), VT::load(w + i)));
  if (dv < dim) {
    const int t = static_cast<int>(dim - dv);
    VT::store_n(out + dv, VT::mul(VT::mul(VT::load_n(x + dv, t), s), VT::load_n(w + dv, t)), t);
  }
}

void rms_norm(const float* x, const float* w, float* out, int64_t dim, float eps) {
  V acc = VT::zero();
  const int64_t dv = dim - dim % W;
  for (int64_t i = 0; i < dv; i += W) {
    const V v = VT::load(x + i);
    acc = VT::fma(v, v, acc);
  }
  if (dv < dim) {
    const V v = VT::load_n(x + dv, static_cast<int>(dim - dv));
    acc = VT::fma(v, v, acc);
  }
  const float inv = 1.0f / __builtin_sqrtf(VT::hsum(acc) / static_cast<float>(dim) + eps);
  scale_store(x, w, out, dim, inv);
}

void add_rms_norm(float* res, const float* x, const float* w, float* out, int64_t dim, float eps) {
  V acc = VT::zero();
  const int64_t dv = dim - dim % W;
  for (int64_t i = 0; i < dv; i += W) {
    const V v = VT::add(VT::load(res + i), VT::load(x + i));
    VT::store(res + i, v);
    acc = VT::fma(v, v, acc);
  }
  if (dv < dim) {
    const int t = static_cast<int>(dim - dv);
    const V v = VT::add(VT::load_n(res + dv, t), VT::load_n(x + dv, t));
    VT::store_n(res + dv, v, t);
    acc = VT::fma(v, v, acc);
  }
  const float inv = 1.0f / __builtin_sqrtf(VT::hsum(acc) / static_cast<float>(dim) + eps);
  scale_store(res, w, out, dim, inv);
}

void rope(float* x, int32_t num_heads, int32_t head_dim, int32_t rotary_dim, const float* cs) {
  const int half = rotary_dim / 2, hv = half - half % W;
  for (int h = 0; h < num_heads; ++h) {
    float* a = x + static_cast<int64_t>(h) * head_dim;
    float* b = a + half;
    for (int i = 0; i < hv; i += W) {
      const V va = VT::load(a + i), vb = VT::load(b + i);
      const V c = VT::load(cs + i), s = VT::load(cs + half + i);
      VT::store(a + i, VT::sub(VT::mul(va, c), VT::mul(vb, s)));
      VT::store(b + i, VT::add(VT::mul(vb, c), VT::mul(va, s)));
    }
    if (hv < half) {
      const int t = half - hv;
      const V va = VT::load_n(a + hv, t), vb = VT::load_n(b + hv, t);
      const V c = VT::load_n(cs + hv, t), s = VT::load_n(cs + half + hv, t);
      VT::store_n(a + hv, VT::sub(VT::mul(va, c), VT::mul(vb, s)), t);
      VT::store_n(b + hv, VT::add(VT::mul(vb, c), VT::mul(va, s)), t);
    }
  }
}

FT_INLINE V silu_v(V g, V u) {
  const V one = VT::set1(1.0f);
  return VT::mul(VT::div(g, VT::add(one, VT::exp(VT::sub(VT::zero(), g)))), u);
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  const int64_t nv = n - n % W;
  for (int64_t i = 0; i < nv; i += W) VT::store(out + i, silu_v(VT::load(gate + i), VT::load(up + i)));
  if (nv < n) {
    const int t = static_cast<int>(n - nv);
    VT::store_n(out + nv, silu_v(VT::load_n(gate + nv, t), VT::load_n(up + nv, t)), t);
  }
}

// gelu_pytorch_tanh(g) * u, with 0.5 g (1 + tanh(a)) written as g / (1 + exp(-2a)) (the same
// function; no cancellation where tanh(a) is near -1), a = sqrt(2 / pi) (g + 0.044715 g^3).
FT_INLINE V gelu_tanh_v(V g, V u) {
  const V one = VT::set1(1.0f);
  const V g3 = VT::mul(VT::mul(g, g), g);
  const V a = VT::mul(VT::set1(-2.0f * 0.7978845608028654f), VT::fma(VT::set1(0.044715f), g3, g));
  return VT::mul(VT::div(g, VT::add(one, VT::exp(a))), u);
}

void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) {
  const int64_t nv = n - n % W;
  for (int64_t i = 0; i < nv; i += W) VT::store(out + i, gelu_tanh_v(VT::load(gate + i), VT::load(up + i)));
  if (nv < n) {
    const int t = static_cast<int>(n - nv);
    VT::store_n(out + nv, gelu_tanh_v(VT::load_n(gate + nv, t), VT::load_n(up + nv, t)), t);
  }
}

void add(float* x, const float* y, int64_t n) {
  const int64_t nv = n - n % W;
  for (int64_t i = 0; i < nv; i += W) VT::store(x + i, VT::add(VT::load(x + i), VT::load(y + i)));
  if (nv < n) {
    const int t = static_cast<int>(n - nv);
    VT::store_n(x + nv, VT::add(VT::load_n(x + nv, t), VT::load_n(y + nv, t)), t);
  }
}

template <int DT>
void to_f32_t(const void* src, float* dst, int64_t n) {
  const int64_t nv = n - n % W;
  for (int64_t i = 0; i < nv; i += W) VT::store(dst + i, loadw<DT>(src, i));
  if (nv < n) VT::store_n(dst + nv, loadw_n<DT>(src, nv, static_cast<int>(n - nv)), static_cast<int>(n - nv));
}

void to_f32(const void* src, DType st, float* dst, int64_t n) {
  switch (st) {
    case DType::kF32: to_f32_t<0>(src, dst, n); return;
    case DType::kF16: to_f32_t<1>(src, dst, n); return;
    case DType::kBF16: to_f32_t<2>(src, dst, n); return;
    case DType::kI8: return;  // KV-cache-only type; the backend rejects it before this
  }
}
