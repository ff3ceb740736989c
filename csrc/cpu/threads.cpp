// init_cpu_threads_env (vLLM v0.6's schema: (str cpu_ids) -> str): binds torch's OpenMP
// threads one per CPU, thread i to cpu_ids[i], and sets torch's thread count to match.
// cpu_ids: comma-separated CPU numbers and ranges ("0-3,8"), each a CPU this process may
// run on, no repeats. OpenMP keeps its worker threads for the process's life, so binding
// them once inside a parallel region pins every later parallel_for; thread 0 is the caller
// (the engine's thread). Returns one line per thread, "thread i -> CPU c". Linux only (the
// affinity calls); elsewhere it is an error. Python callers validate first
// (vllm_lite.config), so the checks here guard C++ callers.
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#if defined(__linux__)
#include <omp.h>
#include <sched.h>
#endif

#include "ops.h"

namespace vllm_lite::cpu {
namespace {

std::vector<int> parse_cpu_ids(const std::string& ids) {
  std::vector<int> cpus;
  std::stringstream ss(ids);
  std::string part;
  while (std::getline(ss, part, ',')) {
    const auto dash = part.find('-');
    char* end = nullptr;
    const long lo = std::strtol(part.c_str(), &end, 10);
    TORCH_CHECK(!part.empty() && end != part.c_str(), "init_cpu_threads_env: cpu_ids '", ids,
                "': '", part, "' is not a CPU number or a range a-b");
    long hi = lo;
    if (dash != std::string::npos) {
      const char* rest = part.c_str() + dash + 1;
      hi = std::strtol(rest, &end, 10);
      TORCH_CHECK(end != rest && *end == '\0' && hi >= lo, "init_cpu_threads_env: cpu_ids '",
                  ids, "': '", part, "' is not a range a-b with a <= b");
    } else {
      TORCH_CHECK(*end == '\0', "init_cpu_threads_env: cpu_ids '", ids, "': '", part,
                  "' is not a CPU number");
    }
    TORCH_CHECK(lo >= 0 && hi < 1 << 16, "init_cpu_threads_env: cpu_ids '", ids,
                "': CPU numbers must be in 0..65535");
    for (long c = lo; c <= hi; ++c) cpus.push_back(static_cast<int>(c));
  }
  TORCH_CHECK(!cpus.empty(), "init_cpu_threads_env: cpu_ids is empty");
  return cpus;
}

}  // namespace

std::string init_cpu_threads_env(const std::string& cpu_ids) {
#if defined(__linux__)
  const std::vector<int> cpus = parse_cpu_ids(cpu_ids);
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  TORCH_CHECK(sched_getaffinity(0, sizeof(allowed), &allowed) == 0,
              "init_cpu_threads_env: sched_getaffinity failed");
  std::vector<bool> seen(1 << 16, false);
  for (const int c : cpus) {
    TORCH_CHECK(c < CPU_SETSIZE && CPU_ISSET(c, &allowed), "init_cpu_threads_env: cpu_ids '",
                cpu_ids, "': CPU ", c, " is not one this process may run on");
    TORCH_CHECK(!seen[c], "init_cpu_threads_env: cpu_ids '", cpu_ids, "': CPU ", c,
                " is listed twice");
    seen[c] = true;
  }
  const int n = static_cast<int>(cpus.size());
  at::set_num_threads(n);
  omp_set_num_threads(n);
  std::vector<int> failed(n, 0);
  int team = 0;
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    if (t == 0) team = omp_get_num_threads();
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[t], &one);
    failed[t] = sched_setaffinity(0, sizeof(one), &one) != 0;
  }
  TORCH_CHECK(team == n, "init_cpu_threads_env: OpenMP gave ", team, " threads, not ", n);
  std::ostringstream out;
  for (int t = 0; t < n; ++t) {
    TORCH_CHECK(!failed[t], "init_cpu_threads_env: binding thread ", t, " to CPU ", cpus[t],
                " failed");
    out << "thread " << t << " -> CPU " << cpus[t] << (t + 1 < n ? "\n" : "");
  }
  return out.str();
#else
  TORCH_CHECK(false, "init_cpu_threads_env: binding threads to CPUs needs Linux");
#endif
}

}  // namespace vllm_lite::cpu
