// 2^t in float32 without libm, branch-free so that a loop over it vectorizes (std::exp does not).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace prfaas {

// 2^t for t in [-126, 127] (t outside is clamped): the exponent's bits times 2^f, f = t - round(t) in [-0.5, 0.5], by
// its Taylor polynomial of degree 6 (relative error about 1e-7). F is float, or a GCC vector of floats whose lanes it
// takes at once, I then the vector of as many int32.
template <typename F, typename I = int32_t>
inline F exp2_clamped(F t) {
  t = t < -126.0f ? F{} - 126.0f : t;
  t = t > 127.0f ? F{} + 127.0f : t;
  const F whole = (t + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23 pushes the fraction out
  const F f = t - whole;
  F p = F{} + 1.540353039e-4f;
  p = p * f + 1.333355815e-3f;
  p = p * f + 9.618129108e-3f;
  p = p * f + 5.550410866e-2f;
  p = p * f + 2.402265070e-1f;
  p = p * f + 6.931471806e-1f;
  p = p * f + 1.0f;
  I bits;
  if constexpr (std::is_same_v<F, float>) {
    bits = (static_cast<int32_t>(whole) + 127) << 23;
  } else {
    bits = (__builtin_convertvector(whole, I) + 127) << 23;
  }
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace prfaas
