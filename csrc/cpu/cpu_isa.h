// Which build of the CPU kernels runs: the widest instruction set this CPU has
// ("amxbf16", "avx512bf16", "avx512", "avx2", else "generic"), unless VLLM_LITE_CPU_ISA
// names another at load time or set_cpu_isa() does later (tests use it to check every
// build on one machine). Each x86 build implies the ones after it: "amxbf16" is
// "avx512bf16" with the bfloat16 GEMMs on AMX tiles (packed_linear_amx.cpp), and runs the
// "avx512bf16" build of every other kernel.
#pragma once

#include <string>
#include <vector>

namespace vllm_lite::cpu {

std::vector<std::string> cpu_isas();  // the builds this CPU can run, widest first
std::string cpu_isa();
void set_cpu_isa(const std::string& name);  // throws c10::Error for an unavailable one
// Whether the selected build implies `name`'s instructions (cpu_isa_includes("avx512") on
// "amxbf16", "avx512bf16" and "avx512"); any build includes "generic".
bool cpu_isa_includes(const std::string& name);

}  // namespace vllm_lite::cpu
