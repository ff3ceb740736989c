// The SIMT emulator's host API: kernel launches (cuda_emu::launch mirrors
// kernel<<<grid, block, smem>>>(args...)), the schedule seed and the dynamic shared memory
// registration. Semantics and limits: emu_runtime.cpp and tests/cuda_emulation/README
// section in README.md ("CUDA kernels without a GPU").
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_shim.h"

namespace cuda_emu {

// CUDA's default dynamic shared memory limit without an opt-in attribute.
constexpr size_t kMaxDynamicSmem = 48 * 1024;

// 0: every block runs its threads in index order, each until it blocks (barrier, shuffle,
// exit); otherwise a PRNG seeded with it picks which runnable thread continues each time
// one blocks, and the order in which blocks are handed to the workers.
void set_schedule_seed(uint64_t seed);
uint64_t schedule_seed();
// Worker threads that run blocks (default: CUDA_EMU_WORKERS, else 2).
void set_workers(int n);

// Registers the thread-local array that `extern __shared__ T name[]` resolves to (see
// CUDA_EMU_DYNAMIC_SHARED); get() returns the calling thread's instance.
bool register_dynamic_smem(void* (*get)());

void launch_blocks(dim3 grid, dim3 block, size_t smem, const char* name,
                   const std::function<void()>& thread_body);

// Appends the kernel's symbol to the file CUDA_EMU_KERNEL_LOG names (when set): which
// template instances a run launched (harness.py turns that into its kernel list).
void log_kernel(const void* kernel);

// kernel<<<grid, block, smem>>>(args...): the arguments are converted to the kernel's
// parameter types and copied once, as CUDA copies them into the parameter buffer.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, const char* name,
            Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "kernel argument count");
  const std::tuple<std::remove_cv_t<Params>...> params(std::forward<Args>(args)...);
  log_kernel(reinterpret_cast<const void*>(kernel));
  launch_blocks(grid, block, smem, name, [&] { std::apply(kernel, params); });
}

}  // namespace cuda_emu

// Defines the storage behind `extern __shared__ TYPE NAME[]` declared in namespace NS:
// kMaxDynamicSmem bytes per worker thread; each launch poisons (ASan) what lies past its
// dynamic size.
#define CUDA_EMU_DYNAMIC_SHARED(NS, TYPE, NAME)                                             \
  namespace NS {                                                                            \
  thread_local __attribute__((aligned(16))) TYPE NAME[::cuda_emu::kMaxDynamicSmem / sizeof(TYPE)]; \
  }                                                                                         \
  static const bool cuda_emu_dynamic_smem_##NAME =                                          \
      ::cuda_emu::register_dynamic_smem([]() -> void* { return NS::NAME; });
