// Stand-in for c10::ScalarType in the CPU emulation build (only what dtype.cuh's dispatch
// macro names).
#pragma once
#include <ostream>

namespace c10 {
enum class ScalarType { Float, Half, BFloat16, Other };
inline std::ostream& operator<<(std::ostream& os, ScalarType t) {
  return os << (t == ScalarType::Float ? "Float" : t == ScalarType::Half ? "Half"
                : t == ScalarType::BFloat16 ? "BFloat16" : "Other");
}
}  // namespace c10
