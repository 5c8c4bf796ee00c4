// One-token attention of a decode step on the CPU: every (row, KV head) reads its keys and values once for all the
// query heads of its group, skipping the positions its mask leaves out (a batch's left padding).
//
// q: [rows, kv_heads, groups, dim]; k, v: [rows, kv_heads, positions, dim] (any strides, the last dimension
// contiguous: the decode batch's in-place buffers are views); mask: none, or bool [rows, positions] (true: attend).
// Returns [rows, kv_heads, groups, dim] in q's dtype. Computed in float32 whatever the dtype, one (row, head) per
// task, so a row's result does not depend on the other rows of its batch.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include "exp2.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr int kMaxDim = 256;

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Sum of a[i] * b[i] in kLanes running partial sums (a fixed order: the same inputs give the same bits).
inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += a[i + l] * b[i + l];
  float sum = 0.0f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

// Sum of a[i] in kLanes running partial sums.
inline float sum(const float* a, int64_t n) {
  float part[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += a[i + l];
  float total = 0.0f;
  for (; i < n; ++i) total += a[i];
  for (int l = 0; l < kLanes; ++l) total += part[l];
  return total;
}

// D: the head dim when known at compile time (the common ones), 0 for any other up to kMaxDim.
template <typename T, int D>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* mask, float scale,
            at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), groups = q.size(2);
  const int64_t positions = k.size(2);
  const int64_t dim = D > 0 ? D : q.size(3);
  constexpr int kBuffer = D > 0 ? D : kMaxDim;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool* mp = mask ? mask->data_ptr<bool>() : nullptr;
  const int64_t ms0 = mask ? mask->stride(0) : 0, ms1 = mask ? mask->stride(1) : 0;
  const float log2e = 1.4426950408889634f;
  // Strides read once: Tensor::stride is an out-of-line call.
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);

  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(groups * dim), scores(groups * positions), top(groups);
    std::vector<uint8_t> keep(positions);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads;
      for (int64_t g = 0; g < groups; ++g) {
        widen(qp + b * qs0 + h * qs1 + g * qs2, qf.data() + g * dim, dim);
        for (int d = 0; d < dim; ++d) qf[g * dim + d] *= scale * log2e;  // scores in base 2
      }
      for (int64_t j = 0; j < positions; ++j) keep[j] = mp ? mp[b * ms0 + j * ms1] : 1;
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      const T* kb = kp + b * ks0 + h * ks1;
      const T* vb = vp + b * vs0 + h * vs1;
      float row[kBuffer];
      for (int64_t j = 0; j < positions; ++j) {
        if (!keep[j]) continue;
        widen(kb + j * ks2, row, dim);
        for (int64_t g = 0; g < groups; ++g) {
          const float s = dot(qf.data() + g * dim, row, dim);
          scores[g * positions + j] = s;
          top[g] = s > top[g] ? s : top[g];
        }
      }
      T* ob = op + (b * heads + h) * groups * dim;
      for (int64_t g = 0; g < groups; ++g) {
        float* p = scores.data() + g * positions;
        const float most = top[g];
        for (int64_t j = 0; j < positions; ++j) p[j] = keep[j] ? prfaas::exp2_clamped(p[j] - most) : 0.0f;
        const float total = sum(p, positions);
        // The group's output in registers (dim floats), over every kept position's value row.
        float acc[kBuffer] = {0};
        for (int64_t j = 0; j < positions; ++j) {
          if (!keep[j]) continue;
          const float w = p[j];
          const T* vr = vb + j * vs2;
          for (int d = 0; d < dim; ++d) acc[d] += w * static_cast<float>(vr[d]);
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int d = 0; d < dim; ++d) ob[g * dim + d] = static_cast<T>(acc[d] * inv);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: 4-D q, k, v");
  TORCH_CHECK(k.sizes() == v.sizes(), "decode_attention: k and v differ in shape");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "decode_attention: q is [rows, kv_heads, groups, dim] over k's [rows, kv_heads, positions, dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "decode_attention: q, k and v differ in dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: the last dimension must be contiguous");
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == q.size(0) &&
                    mask->size(1) == k.size(2),
                "decode_attention: the mask is bool [rows, positions]");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  const at::Tensor* m = mask ? &*mask : nullptr;
  const int64_t dim = q.size(3);
  TORCH_CHECK(dim > 0 && dim <= kMaxDim, "decode_attention: a head dim of 1 to ", kMaxDim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    if (dim == 64) {
      attend<scalar_t, 64>(q, k, v, m, static_cast<float>(scale), out);
    } else if (dim == 128) {
      attend<scalar_t, 128>(q, k, v, m, static_cast<float>(scale), out);
    } else {
      attend<scalar_t, 0>(q, k, v, m, static_cast<float>(scale), out);
    }
  });
  return out;
}

}  // namespace

// A dispatcher op (torch.ops.prfaas.decode_attention): seen by torch's profiler under its name, like ATen's own.
TORCH_LIBRARY(prfaas, library) {
  library.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prfaas, CPU, library) { library.impl("decode_attention", &decode_attention); }
