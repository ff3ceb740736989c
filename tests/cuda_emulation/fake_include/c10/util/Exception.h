// Stand-in for c10's TORCH_CHECK in the CPU emulation build (no libtorch): a failed check
// throws std::runtime_error with the message pieces concatenated.
#pragma once
#include <sstream>
#include <stdexcept>

namespace cuda_emu {
template <typename... Args>
[[noreturn]] inline void torch_check_failed(const char* cond, const Args&... args) {
  std::ostringstream os;
  ((os << args), ...);
  if (sizeof...(Args) == 0) os << "check failed: " << cond;
  throw std::runtime_error(os.str());
}
}  // namespace cuda_emu

#define TORCH_CHECK(cond, ...) \
  ((cond) ? (void)0 : ::cuda_emu::torch_check_failed(#cond, ##__VA_ARGS__))
