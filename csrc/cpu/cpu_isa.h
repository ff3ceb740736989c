// Which build of the CPU attention kernel runs: the widest instruction set this CPU has
// ("avx512", "avx2", else "generic"), unless VLLM_LITE_CPU_ISA names another at load time
// or set_cpu_isa() does later (tests use it to check every build on one machine).
#pragma once

#include <string>
#include <vector>

namespace vllm_lite::cpu {

std::vector<std::string> cpu_isas();  // the builds this CPU can run, widest first
std::string cpu_isa();
void set_cpu_isa(const std::string& name);  // throws c10::Error for an unavailable one

}  // namespace vllm_lite::cpu
