// One-token attention of a decode step on the CPU: every (row, KV head) reads its keys and values once for all the
// query heads of its group, skipping the positions its mask leaves out (a batch's left padding).
//
// q: [rows, kv_heads, groups, dim]; k, v: [rows, kv_heads, positions, dim] (any strides, the last dimension
// contiguous: the decode batch's in-place buffers are views); mask: none, or bool [rows, positions] (true: attend).
// Returns [rows, kv_heads, groups, dim] in q's dtype. Computed in float32 whatever the dtype, one (row, head) per
// task, every sum in an order fixed by the row's own kept positions, so a row's result is the same bits whatever the
// other rows of its batch and however much left padding they give it.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include "exp2.h"
#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace {

// The kernel runs kLanes positions at a time, and its dot products in kLanes partial sums.
using prfaas::kLanes, prfaas::Lanes, prfaas::LaneInts, prfaas::load, prfaas::store;
constexpr int kMaxDim = 256;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kTile = 8;  // value chunks summed side by side

// One step of summing kLanes vectors' lanes together. a and b each hold sums in segments of W lanes (the whole vector,
// for W = kLanes); the result holds a's segments, then b's, each halved: lane i of its first half plus lane i of its
// second. Lane o of the result picks index first(o) of the pair (a's lanes, then b's), and first(o) + W / 2.
template <int W>
constexpr int first(int o) {
  const int side = o / (kLanes / 2), at = o % (kLanes / 2);
  return side * kLanes + at / (W / 2) * W + at % (W / 2);
}

template <int W, int... O>
inline Lanes fold(Lanes a, Lanes b, std::integer_sequence<int, O...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, first<W>(O)...) + __builtin_shufflevector(a, b, (first<W>(O) + W / 2)...);
#else
  return __builtin_shuffle(a, b, LaneInts{first<W>(O)...}) + __builtin_shuffle(a, b, LaneInts{(first<W>(O) + W / 2)...});
#endif
}

// Halves W until it is 1: W vectors of x, whose lanes hold sums in segments of W lanes, become W / 2 vectors of
// segments of W / 2, and so on down to 1 vector of single sums.
template <int W>
inline void fold_all(Lanes* x) {
  if constexpr (W > 1) {
    for (int i = 0; i < W / 2; ++i) x[i] = fold<W>(x[2 * i], x[2 * i + 1], std::make_integer_sequence<int, kLanes>{});
    fold_all<W / 2>(x);
  }
}

// Lane p of the result: the sum of x[p]'s lanes, for the kLanes vectors at once (a transpose and add, log2(kLanes)
// steps; x is overwritten). Every lane is summed in the same order whatever its p, so a position's score does not
// depend on where its block starts.
inline Lanes sum_lanes(Lanes* x) {
  fold_all<kLanes>(x);
  return x[0];
}

// n values widened to float32, zeros after them up to `padded`.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n, int64_t padded) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  for (int64_t i = n; i < padded; ++i) dst[i] = 0.0f;
}

// Sum of a[0..n) in kLanes running partial sums laid from the end (the i-th value from the end in lane i % kLanes,
// counted from the last lane). A decode batch pads its rows on the left, where the weights are zeros, so a row's sum
// is the same bits in any batch.
inline float sum_from_end(const float* a, int64_t n) {
  Lanes part{};
  int64_t i = n;
  for (; i >= kLanes; i -= kLanes) part += load(a + i - kLanes);
  float head[kLanes] = {0};
  for (int64_t l = kLanes - i; l < kLanes; ++l) head[l] = a[i - kLanes + l];
  part += load(head);
  float lanes[kLanes];
  store(lanes, part);
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// D: the head dim when known at compile time (the common ones), 0 for any other up to kMaxDim. Vectors are padded
// with zeros to a multiple of kLanes.
template <typename T, int D>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* mask, float scale,
            at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), groups = q.size(2);
  const int64_t positions = k.size(2);
  const int64_t dim = D > 0 ? D : q.size(3);
  const int64_t padded = (dim + kLanes - 1) / kLanes * kLanes;  // a constant where D is
  const int64_t chunks = padded / kLanes;
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
    std::vector<float> qf(groups * padded), scores(groups * positions), top(groups * kLanes), acc(groups * padded);
    std::vector<float> block(kLanes * padded), weight(groups * kLanes);
    std::vector<uint8_t> copied(positions, 1);  // the row's mask where it is not contiguous; all ones without one
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads;
      for (int64_t g = 0; g < groups; ++g) {
        widen(qp + b * qs0 + h * qs1 + g * qs2, qf.data() + g * padded, dim, padded);
        for (int64_t d = 0; d < dim; ++d) qf[g * padded + d] *= scale * log2e;  // scores in base 2
      }
      const uint8_t* keep = mp && ms1 == 1 ? reinterpret_cast<const uint8_t*>(mp + b * ms0) : copied.data();
      if (mp && ms1 != 1)
        for (int64_t j = 0; j < positions; ++j) copied[j] = mp[b * ms0 + j * ms1];
      std::fill(top.begin(), top.end(), -kInf);
      const T* kb = kp + b * ks0 + h * ks1;
      const T* vb = vp + b * vs0 + h * vs1;
      // Scores, a block of kLanes positions at a time: each position's products in kLanes lanes, the lanes of the
      // block's positions summed together. A block with no kept position is skipped.
      for (int64_t j0 = 0; j0 < positions; j0 += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, positions - j0);
        bool any = false;
        for (int64_t p = 0; p < n; ++p) any |= keep[j0 + p] != 0;
        if (!any) {
          for (int64_t g = 0; g < groups; ++g) std::fill_n(scores.data() + g * positions + j0, n, -kInf);
          continue;
        }
        for (int64_t p = 0; p < kLanes; ++p) {
          if (p < n)
            widen(kb + (j0 + p) * ks2, block.data() + p * padded, dim, padded);
          else
            std::fill_n(block.data() + p * padded, padded, 0.0f);
        }
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = qf.data() + g * padded;
          Lanes part[kLanes];
          for (int p = 0; p < kLanes; ++p) {
            const float* kr = block.data() + p * padded;
            Lanes s = load(qg) * load(kr);
            for (int64_t c = 1; c < chunks; ++c) s += load(qg + c * kLanes) * load(kr + c * kLanes);
            part[p] = s;
          }
          // A masked position's score is -inf: out of the maximum, and a finite input to the exp below.
          float s[kLanes];
          store(s, sum_lanes(part));
          for (int64_t p = 0; p < kLanes; ++p) s[p] = p < n && keep[j0 + p] ? s[p] : -kInf;
          std::memcpy(scores.data() + g * positions + j0, s, n * sizeof(float));
          const Lanes now = load(s), before = load(top.data() + g * kLanes);
          store(top.data() + g * kLanes, now > before ? now : before);
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* p = scores.data() + g * positions;
        float most = -kInf;
        for (int l = 0; l < kLanes; ++l) most = std::max(most, top[g * kLanes + l]);
        for (int64_t j = 0; j < positions; ++j) p[j] = keep[j] ? prfaas::exp2_clamped(p[j] - most) : 0.0f;
      }
      // The groups' outputs over every kept position's value row, a block of rows widened at a time.
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j0 = 0; j0 < positions; j0 += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, positions - j0);
        int64_t kept = 0;
        for (int64_t p = 0; p < n; ++p) {
          if (!keep[j0 + p]) continue;
          widen(vb + (j0 + p) * vs2, block.data() + kept * padded, dim, padded);
          for (int64_t g = 0; g < groups; ++g) weight[g * kLanes + kept] = scores[g * positions + j0 + p];
          ++kept;
        }
        for (int64_t g = 0; g < groups; ++g) {
          float* ag = acc.data() + g * padded;
          // kTile independent running sums: one per chunk of the row, so no sum waits on the one before it.
          for (int64_t c0 = 0; c0 < chunks; c0 += kTile) {
            const int64_t m = std::min<int64_t>(kTile, chunks - c0);
            Lanes a[kTile];
            for (int64_t c = 0; c < m; ++c) a[c] = load(ag + (c0 + c) * kLanes);
            for (int64_t p = 0; p < kept; ++p) {
              const float w = weight[g * kLanes + p];
              const float* vr = block.data() + p * padded + c0 * kLanes;
              for (int64_t c = 0; c < m; ++c) a[c] += w * load(vr + c * kLanes);
            }
            for (int64_t c = 0; c < m; ++c) store(ag + (c0 + c) * kLanes, a[c]);
          }
        }
      }
      T* ob = op + (b * heads + h) * groups * dim;
      for (int64_t g = 0; g < groups; ++g) {
        const float total = sum_from_end(scores.data() + g * positions, positions);
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < dim; ++d) ob[g * dim + d] = static_cast<T>(acc[g * padded + d] * inv);
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
