// The runner: `vllm_lite_tests` runs every test, `vllm_lite_tests NAME...` the named ones,
// `vllm_lite_tests --list` prints the names. Exit status 0 when all pass.
#include "harness.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <iostream>
#include <map>

namespace vllm_lite::test {
namespace {

std::map<std::string, std::function<void()>>& registry() {
  static std::map<std::string, std::function<void()>> tests;
  return tests;
}

}  // namespace

int register_test(const char* name, std::function<void()> fn) {
  registry().emplace(name, std::move(fn));
  return 0;
}

}  // namespace vllm_lite::test

int main(int argc, char** argv) {
  auto& tests = vllm_lite::test::registry();
  if (argc == 2 && std::strcmp(argv[1], "--list") == 0) {
    for (const auto& [name, fn] : tests) std::cout << name << "\n";
    return 0;
  }
  std::map<std::string, std::function<void()>> chosen;
  if (argc == 1) {
    chosen = tests;
  } else {
    for (int i = 1; i < argc; ++i) {
      auto it = tests.find(argv[i]);
      if (it == tests.end()) {
        std::cerr << "no test named " << argv[i] << " (see --list)\n";
        return 2;
      }
      chosen.insert(*it);
    }
  }
  int failed = 0;
  for (const auto& [name, fn] : chosen) {
    const auto start = std::chrono::steady_clock::now();
    try {
      fn();
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      std::cout << "[PASS] " << name << " (" << took.count() << " s)\n";
    } catch (const vllm_lite::test::Failure& e) {
      ++failed;
      std::cout << "[FAIL] " << name << ": " << e.what() << "\n";
    } catch (const c10::Error& e) {
      ++failed;
      std::cout << "[FAIL] " << name << ": unexpected c10::Error: " << e.what_without_backtrace()
                << "\n";
    } catch (const std::exception& e) {
      ++failed;
      std::cout << "[FAIL] " << name << ": unexpected exception: " << e.what() << "\n";
    }
  }
  std::cout << chosen.size() - failed << " of " << chosen.size() << " tests passed\n";
  return failed == 0 ? 0 : 1;
}
