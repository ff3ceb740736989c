// A small test runner for the C++ tests (no dependency beyond libtorch): VLLM_TEST(name)
// defines a test, TEST_CHECK* fail it with a message, the runner (harness.cpp) runs the tests
// named on its command line, or all of them. ctest runs each test as its own process.
#pragma once

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

namespace vllm_lite::test {

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int register_test(const char* name, std::function<void()> fn);

[[noreturn]] inline void fail(const char* file, int line, const std::string& msg) {
  std::ostringstream s;
  s << file << ":" << line << ": " << msg;
  throw Failure(s.str());
}

}  // namespace vllm_lite::test

#define VLLM_TEST(name)                                                              \
  static void vllm_test_##name();                                                    \
  [[maybe_unused]] static const int vllm_test_reg_##name =                           \
      ::vllm_lite::test::register_test(#name, vllm_test_##name);                     \
  static void vllm_test_##name()

// TEST_CHECK(cond) << "context";  fails the test when cond is false.
#define TEST_CHECK_MSG(cond, ...)                                                         \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream vllm_s_;                                                    \
      vllm_s_ << "TEST_CHECK(" #cond ") failed" __VA_OPT__(<< ": " << __VA_ARGS__);       \
      ::vllm_lite::test::fail(__FILE__, __LINE__, vllm_s_.str());                    \
    }                                                                                \
  } while (0)
#define TEST_CHECK(cond) TEST_CHECK_MSG(cond)

// Runs stmt, which must throw c10::Error whose message contains substr.
#define TEST_CHECK_THROWS_WITH(stmt, substr)                                              \
  do {                                                                               \
    bool vllm_threw_ = false;                                                        \
    try {                                                                            \
      stmt;                                                                          \
    } catch (const c10::Error& e) {                                                  \
      vllm_threw_ = true;                                                            \
      const std::string vllm_msg_ = e.what_without_backtrace();                      \
      TEST_CHECK_MSG(vllm_msg_.find(substr) != std::string::npos,                         \
                "message \"" << vllm_msg_ << "\" lacks \"" << (substr) << "\"");     \
    }                                                                                \
    TEST_CHECK_MSG(vllm_threw_, #stmt " did not throw c10::Error");                       \
  } while (0)
