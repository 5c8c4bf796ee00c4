// A vector of float32 lanes as wide as the machine's registers (GCC's vector extension: the compiler maps the type
// onto them), for the attention kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace prfaas {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t LaneInts __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Lanes load(const float* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void store(float* p, Lanes x) { std::memcpy(p, &x, sizeof(x)); }

}  // namespace prfaas
