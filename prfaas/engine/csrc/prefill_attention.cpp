// Attention of a prefill pass (many queries) on the CPU, flash-style: a tile of query rows against a block of keys
// at a time, with a running softmax, so no score matrix is ever written out.
//
// q: [batch, heads, queries, dim]; k, v: [batch, kv_heads, keys, dim] (any strides, the last dimension contiguous);
// heads = kv_heads × groups (grouped-query attention reads each key once for all the heads of its group); mask: none,
// or bool [batch, queries, keys] (true: attend; any strides); causal (without a mask): query i attends keys 0 … i,
// queries = keys. Returns [batch, queries, heads, dim] (the layout a model's output projection reads) in q's dtype.
//
// Computed in float32 whatever the dtype. Keys are taken in blocks of kLanes at fixed offsets (0, kLanes, …), and a
// query row's sums run over its own blocks in order, whatever the other rows of its tile: a row's result is the same
// bits however the pass is cut into chunks. A block no row of a tile attends to is skipped; a row that attends to
// nothing gets zeros.

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
#include <vector>

namespace {

using prfaas::kLanes, prfaas::Lanes, prfaas::LaneInts, prfaas::load, prfaas::store;
constexpr int kRows = 12;  // query rows of a tile: their score sums stay in registers beside one key vector
constexpr int kTiles = 8;  // tiles of a task, which take each key block in turn while it is in the cache
constexpr int kMaxDim = 256;
constexpr float kInf = std::numeric_limits<float>::infinity();

inline float lane_max(Lanes x) {
  float l[kLanes];
  store(l, x);
  float m = l[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, l[i]);
  return m;
}

// prfaas::exp2_clamped on every lane at once; -inf gives 0.
inline Lanes exp2_lanes(Lanes x) { return x == -kInf ? Lanes{} : prfaas::exp2_clamped<Lanes, LaneInts>(x); }

// Which keys a query row attends: those in [lo, hi], all of them where `dense`, else as its mask row says.
struct Span {
  int64_t lo, hi;  // hi < lo: none
  bool dense;
};

// A tile's query rows (widened, scaled to base-2 scores), their outputs so far and their running softmax.
struct Tile {
  float* q;
  float* acc;
  int rows;
  int64_t first, last;  // the key blocks any of its rows attends to
  int64_t query_of[kRows], head_of[kRows];
  float top[kRows];
  Lanes total[kRows];  // each row's softmax denominator, in lanes
};

template <typename T, int D>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* mask, bool causal,
            float scale, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2);
  const int64_t kv_heads = k.size(1), keys = k.size(2);
  const int64_t groups = heads / kv_heads;
  const int64_t dim = D > 0 ? D : q.size(3);
  const int64_t padded = (dim + kLanes - 1) / kLanes * kLanes;
  const int64_t chunks = padded / kLanes;
  const int64_t blocks = (keys + kLanes - 1) / kLanes;
  // A tile: `group_span` heads of one KV head's group × `positions` query positions, at most kRows rows.
  const int64_t group_span = std::min<int64_t>(groups, kRows);
  const int64_t group_tiles = (groups + group_span - 1) / group_span;
  const int64_t positions = std::max<int64_t>(1, kRows / group_span);
  const int64_t position_tiles = (queries + positions - 1) / positions;
  const float log2e = 1.4426950408889634f;

  // Each (batch, KV head)'s keys widened and laid out a block at a time as [dim][kLanes] (a key per lane, so one
  // vector load serves every row of a tile), its values widened as [keys][padded]; zeros past the last key.
  at::Tensor key_t = at::zeros({batch * kv_heads * blocks * dim * kLanes}, q.options().dtype(at::kFloat));
  at::Tensor value_f = at::zeros({batch * kv_heads * blocks * kLanes * padded}, q.options().dtype(at::kFloat));
  float* kt = key_t.data_ptr<float>();
  float* vf = value_f.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  at::parallel_for(0, batch * kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, blk = task % blocks, b = bh / kv_heads, h = bh % kv_heads;
      float* kb = kt + (bh * blocks + blk) * dim * kLanes;
      float* vb = vf + (bh * blocks + blk) * kLanes * padded;
      const int64_t n = std::min<int64_t>(kLanes, keys - blk * kLanes);
      for (int64_t l = 0; l < n; ++l) {
        const T* kr = kp + b * ks0 + h * ks1 + (blk * kLanes + l) * ks2;
        const T* vr = vp + b * vs0 + h * vs1 + (blk * kLanes + l) * vs2;
        for (int64_t d = 0; d < dim; ++d) kb[d * kLanes + l] = static_cast<float>(kr[d]);
        for (int64_t d = 0; d < dim; ++d) vb[l * padded + d] = static_cast<float>(vr[d]);
      }
    }
  });

  // Each query row's span of keys: from the mask, or causal, or every key.
  std::vector<Span> spans(batch * queries);
  const bool* mp = mask ? mask->data_ptr<bool>() : nullptr;
  const int64_t ms0 = mask ? mask->stride(0) : 0, ms1 = mask ? mask->stride(1) : 0, ms2 = mask ? mask->stride(2) : 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < queries; ++i) {
      Span s{0, causal ? i : keys - 1, true};
      if (mp) {
        const bool* row = mp + b * ms0 + i * ms1;
        s.lo = 0;
        while (s.lo < keys && !row[s.lo * ms2]) ++s.lo;
        s.hi = keys - 1;
        while (s.hi >= s.lo && !row[s.hi * ms2]) --s.hi;
        for (int64_t j = s.lo; j <= s.hi && s.dense; ++j) s.dense = row[j * ms2];
      }
      spans[b * queries + i] = s;
    }
  }

  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  // Tasks: (batch, KV head, group tile) × runs of kTiles position tiles, which take each key block in turn while it
  // is in the core's cache. A head's runs are ordered first, last, second, second last… so that any stretch of
  // tasks mixes short causal rows with long ones and the threads' shares even out.
  const int64_t runs = (position_tiles + kTiles - 1) / kTiles;
  const int64_t per_head = group_tiles * runs;
  at::parallel_for(0, batch * kv_heads * per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kTiles * kRows * padded), acc(kTiles * kRows * padded), weight(kRows * kLanes);
    std::vector<Tile> tiles(kTiles);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / per_head, rest = task % per_head, b = bh / kv_heads, h = bh % kv_heads;
      const int64_t gt = rest / runs, order = rest % runs;
      const int64_t run = order % 2 == 0 ? order / 2 : runs - 1 - order / 2;
      const int64_t g0 = gt * group_span, g1 = std::min<int64_t>(groups, g0 + group_span);
      const int64_t t1 = std::min<int64_t>(position_tiles, (run + 1) * kTiles);
      int n = 0;
      int64_t first = blocks, last = -1;
      for (int64_t pt = run * kTiles; pt < t1; ++pt, ++n) {
        Tile& t = tiles[n];
        t.q = qf.data() + n * kRows * padded;
        t.acc = acc.data() + n * kRows * padded;
        t.rows = 0;
        t.first = blocks;
        t.last = -1;
        const int64_t p0 = pt * positions, p1 = std::min<int64_t>(queries, p0 + positions);
        for (int64_t i = p0; i < p1; ++i) {
          for (int64_t g = g0; g < g1; ++g) {
            t.query_of[t.rows] = i;
            t.head_of[t.rows] = h * groups + g;
            const T* qr = qp + b * qs0 + t.head_of[t.rows] * qs1 + i * qs2;
            float* dst = t.q + t.rows * padded;
            for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(qr[d]) * scale * log2e;  // base-2 scores
            for (int64_t d = dim; d < padded; ++d) dst[d] = 0.0f;
            ++t.rows;
          }
          const Span& s = spans[b * queries + i];
          if (s.hi >= s.lo) {
            t.first = std::min(t.first, s.lo / kLanes);
            t.last = std::max(t.last, s.hi / kLanes);
          }
        }
        for (int r = t.rows; r < kRows; ++r) std::fill_n(t.q + r * padded, padded, 0.0f);
        std::fill_n(t.acc, kRows * padded, 0.0f);
        std::fill_n(t.top, kRows, -kInf);
        for (int r = 0; r < kRows; ++r) t.total[r] = Lanes{};
        first = std::min(first, t.first);
        last = std::max(last, t.last);
      }
      const float* kbase = kt + bh * blocks * dim * kLanes;
      const float* vbase = vf + bh * blocks * kLanes * padded;
      for (int64_t blk = first; blk <= last; ++blk) {
        for (int i = 0; i < n; ++i) {
          Tile& t = tiles[i];
          if (blk < t.first || blk > t.last) continue;
          const int64_t j0 = blk * kLanes;
          // Scores: kRows sums of kLanes keys each, one key vector per dimension shared by all rows.
          Lanes s[kRows];
          for (int r = 0; r < kRows; ++r) s[r] = Lanes{};
          const float* kb = kbase + blk * dim * kLanes;
          for (int64_t d = 0; d < dim; ++d) {
            const Lanes kd = load(kb + d * kLanes);
            for (int r = 0; r < kRows; ++r) s[r] += t.q[r * padded + d] * kd;
          }
          // The running softmax, row by row: keys outside the row's span (or off in its mask) score -inf.
          for (int r = 0; r < t.rows; ++r) {
            const Span& sp = spans[b * queries + t.query_of[r]];
            float* w = weight.data() + r * kLanes;
            if (sp.hi < j0 || sp.lo >= j0 + kLanes || sp.hi < sp.lo) {
              std::fill_n(w, kLanes, 0.0f);
              continue;
            }
            Lanes sc = s[r];
            if (!(sp.dense && sp.lo <= j0 && j0 + kLanes - 1 <= sp.hi)) {
              const bool* row = mp ? mp + b * ms0 + t.query_of[r] * ms1 : nullptr;
              float kept[kLanes];
              for (int l = 0; l < kLanes; ++l) {
                const int64_t j = j0 + l;
                kept[l] = j >= sp.lo && j <= sp.hi && (sp.dense || row[j * ms2]) ? 0.0f : -kInf;
              }
              sc += load(kept);
            }
            const float most = lane_max(sc);
            if (most == -kInf) {
              std::fill_n(w, kLanes, 0.0f);
              continue;
            }
            if (most > t.top[r]) {
              const float shrink = t.top[r] == -kInf ? 0.0f : prfaas::exp2_clamped(t.top[r] - most);
              t.total[r] *= shrink;
              float* a = t.acc + r * padded;
              for (int64_t c = 0; c < chunks; ++c) store(a + c * kLanes, load(a + c * kLanes) * shrink);
              t.top[r] = most;
            }
            const Lanes e = exp2_lanes(sc - t.top[r]);
            store(w, e);
            t.total[r] += e;
          }
          // Values: each row's weighted sum of the block's value rows, a value vector loaded once for three rows
          // where the row fits in four vectors (head dims up to 4 × kLanes), once per row otherwise.
          const float* vb = vbase + blk * kLanes * padded;
          if (chunks <= 4) {
            for (int r0 = 0; r0 < t.rows; r0 += 3) {
              const int m = std::min(3, t.rows - r0);
              Lanes a[3][4];
              for (int rr = 0; rr < m; ++rr)
                for (int64_t c = 0; c < chunks; ++c) a[rr][c] = load(t.acc + (r0 + rr) * padded + c * kLanes);
              for (int l = 0; l < kLanes; ++l) {
                const float* vr = vb + l * padded;
                for (int64_t c = 0; c < chunks; ++c) {
                  const Lanes vv = load(vr + c * kLanes);
                  for (int rr = 0; rr < m; ++rr) a[rr][c] += weight[(r0 + rr) * kLanes + l] * vv;
                }
              }
              for (int rr = 0; rr < m; ++rr)
                for (int64_t c = 0; c < chunks; ++c) store(t.acc + (r0 + rr) * padded + c * kLanes, a[rr][c]);
            }
          } else {
            for (int r = 0; r < t.rows; ++r) {
              float* ar = t.acc + r * padded;
              const float* wr = weight.data() + r * kLanes;
              for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
                const int64_t m = std::min<int64_t>(8, chunks - c0);
                Lanes a[8];
                for (int64_t c = 0; c < m; ++c) a[c] = load(ar + (c0 + c) * kLanes);
                for (int l = 0; l < kLanes; ++l) {
                  const float* vr = vb + l * padded + c0 * kLanes;
                  for (int64_t c = 0; c < m; ++c) a[c] += wr[l] * load(vr + c * kLanes);
                }
                for (int64_t c = 0; c < m; ++c) store(ar + (c0 + c) * kLanes, a[c]);
              }
            }
          }
        }
      }
      for (int i = 0; i < n; ++i) {
        const Tile& t = tiles[i];
        for (int r = 0; r < t.rows; ++r) {
          float lanes[kLanes], sum = 0.0f;
          store(lanes, t.total[r]);
          for (int l = 0; l < kLanes; ++l) sum += lanes[l];
          const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
          T* o = op + ((b * queries + t.query_of[r]) * heads + t.head_of[r]) * dim;
          const float* a = t.acc + r * padded;
          for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(a[d] * inv);
        }
      }
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& mask, bool causal, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "prefill_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "prefill_attention: 4-D q, k, v");
  TORCH_CHECK(k.sizes() == v.sizes(), "prefill_attention: k and v differ in shape");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "prefill_attention: q is [batch, kv_heads × groups, queries, dim] over k's [batch, kv_heads, keys, dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "prefill_attention: q, k and v differ in dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "prefill_attention: the last dimension must be contiguous");
  if (mask) {
    TORCH_CHECK(!causal, "prefill_attention: a mask or causal, not both");
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 3 && mask->size(0) == q.size(0) &&
                    mask->size(1) == q.size(2) && mask->size(2) == k.size(2),
                "prefill_attention: the mask is bool [batch, queries, keys]");
  }
  TORCH_CHECK(!causal || q.size(2) == k.size(2), "prefill_attention: causal needs as many queries as keys");
  const int64_t dim = q.size(3);
  TORCH_CHECK(dim > 0 && dim <= kMaxDim, "prefill_attention: a head dim of 1 to ", kMaxDim);
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), dim}, q.options());
  if (q.numel() == 0 || k.size(2) == 0) return out.zero_();
  const at::Tensor* m = mask ? &*mask : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    if (dim == 64) {
      attend<scalar_t, 64>(q, k, v, m, causal, static_cast<float>(scale), out);
    } else if (dim == 128) {
      attend<scalar_t, 128>(q, k, v, m, causal, static_cast<float>(scale), out);
    } else {
      attend<scalar_t, 0>(q, k, v, m, causal, static_cast<float>(scale), out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prfaas, library) {
  library.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prfaas, CPU, library) { library.impl("prefill_attention", &prefill_attention); }
