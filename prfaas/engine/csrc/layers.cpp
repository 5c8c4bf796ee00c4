// The per-layer operators of a Llama-family decoder as one operator each (prfaas/engine/fused.py puts them in):
// RMSNorm, SiLU-and-multiply over a merged gate/up projection, and the rotary embedding of the query and key parts
// of a merged query/key/value projection. transformers runs each as several PyTorch operators (RMSNorm as seven,
// the rotary embedding as sixteen), and at decode's sizes an operator's dispatch, not its arithmetic, is its cost.
//
// Each follows transformers' arithmetic step by step, rounding to the tensor's dtype where its operators round
// (a bfloat16 operator computes in float32 and rounds its result): the rotary embedding gives the same bits as
// transformers' operators, SiLU-and-multiply the same up to its exp's last bits (a polynomial of its own, about 1e-7
// relative); RMSNorm sums its squares in a fixed order of its own, so its variance may differ from PyTorch's mean in
// the last bit. Rows run in parallel on torch's thread pool where there are enough of them, one row per task, so a
// row's result does not depend on its batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "exp2.h"

#include <cmath>
#include <cstdint>
#include <tuple>

// A product and a sum stay two roundings, as PyTorch's two operators are (GCC would fuse them into one FMA).
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int kLanes = 16;
constexpr int64_t kGrainElements = 1 << 15;  // elements a task takes at least: small batches run on one thread

// At least one row a task, and enough rows that a task is worth its hand-over.
inline int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), x widened to float32 (transformers' LlamaRMSNorm).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      T* orow = out + r * width;
      float part[kLanes] = {0};
      int64_t i = 0;
      for (; i + kLanes <= width; i += kLanes)
        for (int l = 0; l < kLanes; ++l) {
          const float v = static_cast<float>(xr[i + l]);
          part[l] += v * v;
        }
      float squares = 0.0f;
      for (; i < width; ++i) squares += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      for (int l = 0; l < kLanes; ++l) squares += part[l];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
      for (int64_t j = 0; j < width; ++j) {
        const T normed = round_to<T>(static_cast<float>(xr[j]) * inv);
        orow[j] = round_to<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight differ in dtype");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: weight is [width] for x's [..., width]");
  const at::Tensor input = x.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty(input.sizes(), input.options());
  const int64_t width = input.size(-1);
  const int64_t rows = width ? input.numel() / width : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(input.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows,
                            width, static_cast<float>(eps));
  });
  return out;
}

// x: [..., 2 * width], gate then up; out: silu(gate).to(dtype) * up, rounded as transformers' two operators round.
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "silu_mul: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_mul: the last dimension is gate then up, of equal width");
  const at::Tensor input = x.contiguous();
  const int64_t width = input.size(-1) / 2;
  const int64_t rows = width ? input.numel() / (2 * width) : 0;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, input.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = input.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * width;
        const scalar_t* up = gate + width;
        scalar_t* orow = o + r * width;
        for (int64_t j = 0; j < width; ++j) {
          const float g = static_cast<float>(gate[j]);
          const scalar_t act = round_to<scalar_t>(g / (1.0f + prfaas::exp2_clamped(-g * 1.4426950408889634f)));
          orow[j] = round_to<scalar_t>(static_cast<float>(act) * static_cast<float>(up[j]));
        }
      }
    });
  });
  return out;
}

// qkv: [batch, seq, (heads + 2 * kv_heads) * dim], a merged projection's output; cos, sin: [batch or 1, seq, dim].
// Returns the query and key parts rotated, [batch, seq, heads, dim] and [batch, seq, kv_heads, dim]:
// x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype (transformers' apply_rotary_pos_emb).
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                          int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "rotary: CPU tensors only");
  TORCH_CHECK(qkv.dim() == 3 && cos.dim() == 3 && cos.sizes() == sin.sizes(), "rotary: 3-D qkv, cos and sin");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              "rotary: qkv, cos and sin differ in dtype");
  const int64_t batch = qkv.size(0), seq = qkv.size(1), dim = cos.size(2);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && dim > 0 && dim % 2 == 0 && qkv.size(2) == (heads + 2 * kv_heads) * dim,
              "rotary: qkv's last dimension is (heads + 2 * kv_heads) * dim, dim even");
  TORCH_CHECK((cos.size(0) == batch || cos.size(0) == 1) && cos.size(1) == seq,
              "rotary: cos and sin are [batch or 1, seq, dim]");
  TORCH_CHECK(cos.stride(2) == 1 && sin.stride(2) == 1, "rotary: cos and sin's last dimension must be contiguous");
  const at::Tensor input = qkv.contiguous();
  at::Tensor q = at::empty({batch, seq, heads, dim}, input.options());
  at::Tensor k = at::empty({batch, seq, kv_heads, dim}, input.options());
  const int64_t width = input.size(2), half = dim / 2, rotated = heads + kv_heads;
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), cs = cos.stride(1);
  const int64_t sb = sin.size(0) == 1 ? 0 : sin.stride(0), ss = sin.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "rotary", [&] {
    using T = scalar_t;
    const T* in = input.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    at::parallel_for(0, batch * seq, grain(rotated * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / seq, s = t % seq;
        const T* c = cp + b * cb + s * cs;
        const T* sn = sp + b * sb + s * ss;
        for (int64_t h = 0; h < rotated; ++h) {
          const T* x = in + t * width + h * dim;
          T* o = h < heads ? qp + (t * heads + h) * dim : kp + (t * kv_heads + h - heads) * dim;
          for (int64_t i = 0; i < dim; ++i) {
            // rotate_half: (-x2, x1); negation is exact in every dtype.
            const float other = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
            const T straight = round_to<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
            const T turned = round_to<T>(other * static_cast<float>(sn[i]));
            o[i] = round_to<T>(static_cast<float>(straight) + static_cast<float>(turned));
          }
        }
      }
    });
  });
  return {q, k};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prfaas, library) {
  library.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  library.def("silu_mul(Tensor x) -> Tensor");
  library.def("rotary(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(prfaas, CPU, library) {
  library.impl("rms_norm", &rms_norm);
  library.impl("silu_mul", &silu_mul);
  library.impl("rotary", &rotary);
}
