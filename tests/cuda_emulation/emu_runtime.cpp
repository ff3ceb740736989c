// The SIMT emulator: runs a kernel's blocks on a pool of worker threads, and the threads
// of one block as cooperative fibers on one worker (see "execution contexts" below).
//
// Scheduling: a fiber runs until it blocks (__syncthreads, __syncwarp, a shuffle) or
// exits; then the scheduler picks the next runnable fiber: in index order (seed 0) or at
// random (seed != 0), so code that relies on an ordering no barrier enforces computes
// different results under different seeds.
//
// Semantics, chosen to be at least as strict as CUDA C++ (which leaves these undefined):
//   __syncthreads: every thread of the block must arrive at the same __syncthreads (same
//     source line). A thread arriving after another thread exited, a thread exiting while
//     others wait, or threads waiting at different __syncthreads -> error.
//   shuffles / __syncwarp: every lane named by the mask must arrive (any shuffle site)
//     with the same mask; the mask must name the calling lane and lanes that exist; a
//     lane reading a lane outside the mask, or a lane of the mask exiting while others
//     wait for it -> error.
//   No runnable fiber while some have not finished -> deadlock error with every thread's
//     state. Errors print "CUDA_EMU ERROR: ..." and abort the process.
// Shared memory: every thread_local of the executable (all __shared__ variables, see
// cuda_shim.h) is filled with the word 0x7fab7fab at block start (NaN as float, as each
// half and as each bfloat16; a huge int), so reading uninitialised shared memory shows.
// Fiber stacks and switches are annotated for AddressSanitizer.
#include "emu_runtime.h"

#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

namespace cuda_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // ASan's error reports need deep stacks
constexpr uint32_t kPoisonWord = 0x7fab7fabu;

std::atomic<uint64_t> g_seed{0};
std::atomic<int> g_workers{0};
std::mutex g_dyn_mutex;
std::vector<void* (*)()>& dyn_getters() {
  static std::vector<void* (*)()> v;
  return v;
}

// ---- execution contexts: a fiber's or the scheduler's registers while switched out.
//
// On x86-64 a hand-written switch (context_switch below) saves the callee-saved registers
// and the SSE / x87 control words on the stack it leaves. glibc's swapcontext also saves
// and restores the signal mask, a system call per switch that the fibers do not need and
// that took about a third of the emulator's time. Elsewhere: ucontext.
#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
};
extern "C" void cuda_emu_context_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl cuda_emu_context_switch
  .type cuda_emu_context_switch, @function
cuda_emu_context_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emu_context_switch, .-cuda_emu_context_switch
  .section .note.GNU-stack, "", @progbits
  .text
)");

// A context that starts entry() on the stack [stack, stack + bytes): the frame the switch
// above restores (control words, six zeroed registers, entry as the return address) and a
// null return address above it, so entry starts with the stack aligned as after a call.
void context_init(Context& c, char* stack, size_t bytes, void (*entry)()) {
  auto* top = reinterpret_cast<uint64_t*>(
      reinterpret_cast<uintptr_t>(stack + bytes) & ~static_cast<uintptr_t>(15));
  uint64_t* sp = top - 9;
  uint32_t mxcsr = 0;
  uint16_t fcw = 0;
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(mxcsr), "=m"(fcw));
  sp[0] = mxcsr | static_cast<uint64_t>(fcw) << 32;
  for (int i = 1; i <= 6; ++i) sp[i] = 0;  // r15, r14, r13, r12, rbx, rbp
  sp[7] = reinterpret_cast<uint64_t>(entry);
  sp[8] = 0;
  c.sp = sp;
}

void context_switch(Context& save, Context& load) { cuda_emu_context_switch(&save.sp, load.sp); }
#else
struct Context {
  ucontext_t uc;
};

void context_init(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
  // makecontext alone reads uc_stack. ASan's swapcontext interceptor clears the shadow of
  // the stack uc_stack names on every switch into the context: a memset of an eighth of
  // the stack per switch, which also wiped the redzones of the frames a resumed fiber
  // still has live. The fiber annotations (switch_to_fiber) tell ASan which stack runs.
  c.uc.uc_stack.ss_size = 0;
}

void context_switch(Context& save, Context& load) { swapcontext(&save.uc, &load.uc); }
#endif

enum class State { Runnable, AtBarrier, AtWarpOp, Done };
enum class WarpOpKind { Syncwarp, Shfl, Collective };

struct PendingCopy {
  char* dst;
  int bytes;
  uint64_t group;            // the number of commits before it was issued
  unsigned char data[16];    // the source bytes (read at issue; zeros past src_bytes)
  const char* where;
};

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  void* fake_stack = nullptr;  // ASan's fake stack of this fiber while switched out
  uint3 idx{};
  int linear = 0;
  State state = State::Runnable;
  const char* where = "";
  WarpOpKind op = WarpOpKind::Syncwarp;  // which warp operation it waits at (AtWarpOp)
  int kind = 0, arg = 0, width = 32;
  uint64_t value = 0, result = 0;
  WarpCollectiveFn coll_fn = nullptr;  // a warp collective's instruction and lane operands
  void* coll_data = nullptr;
  // cp.async copies issued and not yet performed: each performs at the first
  // cp_async_wait that its group must be complete for (see cp_async_wait).
  std::vector<PendingCopy> copies;
  uint64_t commits = 0;  // cp.async groups committed so far
};

struct Warp {
  unsigned arrived = 0;
  unsigned mask = 0;
};

struct Worker {
  std::vector<Fiber> fibers;
  Context sched_ctx;
  void* sched_fake_stack = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
  Fiber* cur = nullptr;

  const char* kernel = "";
  const std::function<void()>* body = nullptr;
  uint3 block{};
  dim3 bdim, gdim;
  int nthreads = 0;
  size_t smem = 0;
  int at_barrier = 0;
  const char* barrier_where = nullptr;
  int exited = 0;
  std::vector<Warp> warps;
  std::vector<int> runnable;
  bool random = false;
  std::mt19937_64 rng;

  char* tls_begin = nullptr;  // this thread's block of the executable's thread_locals
  size_t tls_size = 0;
};

// The only thread_local of the emulator itself; everything else in the executable's TLS
// segment is kernel shared memory.
thread_local Worker* t_worker = nullptr;

[[noreturn]] void fail(const char* fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  Worker* w = t_worker;
  if (w != nullptr && w->cur != nullptr) {
    fprintf(stderr, "CUDA_EMU ERROR: kernel %s, block (%u,%u,%u), thread (%u,%u,%u): %s\n",
            w->kernel, w->block.x, w->block.y, w->block.z, w->cur->idx.x, w->cur->idx.y,
            w->cur->idx.z, msg);
  } else if (w != nullptr) {
    fprintf(stderr, "CUDA_EMU ERROR: kernel %s, block (%u,%u,%u): %s\n", w->kernel, w->block.x,
            w->block.y, w->block.z, msg);
  } else {
    fprintf(stderr, "CUDA_EMU ERROR: %s\n", msg);
  }
  fflush(stderr);
  abort();
}

Worker& worker() {
  Worker* w = t_worker;
  if (w == nullptr || w->cur == nullptr) fail("a CUDA device function was called outside a kernel");
  return *w;
}

// ---- fiber switching (ASan: tell it which stack runs, see sanitizer/common_interface_defs.h)

void switch_to_fiber(Worker& w, Fiber& f) {
  w.cur = &f;
#if EMU_ASAN
  __sanitizer_start_switch_fiber(&w.sched_fake_stack, f.stack, kStackBytes);
#endif
  context_switch(w.sched_ctx, f.ctx);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(w.sched_fake_stack, nullptr, nullptr);
#endif
  w.cur = nullptr;
}

void yield_to_scheduler(Worker& w) {
  Fiber& f = *w.cur;
#if EMU_ASAN
  __sanitizer_start_switch_fiber(f.state == State::Done ? nullptr : &f.fake_stack,
                                 w.sched_bottom, w.sched_size);
#endif
  context_switch(f.ctx, w.sched_ctx);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, &w.sched_bottom, &w.sched_size);
#endif
}

void make_runnable(Worker& w, Fiber& f) {
  f.state = State::Runnable;
  w.runnable.push_back(f.linear);
}

const char* state_name(const Fiber& f) {
  switch (f.state) {
    case State::Runnable: return "runnable";
    case State::AtBarrier: return "waits at __syncthreads";
    case State::AtWarpOp:
      return f.op == WarpOpKind::Shfl ? "waits at a shuffle"
             : f.op == WarpOpKind::Syncwarp ? "waits at __syncwarp"
                                           : "waits at a warp collective (mma / ldmatrix)";
    case State::Done: return "exited";
  }
  return "?";
}

void on_exit(Worker& w, Fiber& f) {
  if (!f.copies.empty()) {
    fail("exited with %zu cp.async copies (the first issued at %s) that no "
         "cp.async.wait_group completed", f.copies.size(), f.copies.front().where);
  }
  f.state = State::Done;
  ++w.exited;
  if (w.at_barrier > 0) {
    fail("exited while %d threads of the block wait at __syncthreads (%s): a divergent "
         "barrier (undefined behaviour in CUDA)", w.at_barrier, w.barrier_where);
  }
  const Warp& warp = w.warps[f.linear / 32];
  if (warp.arrived != 0 && (warp.mask >> (f.linear % 32) & 1u)) {
    fail("exited while lanes 0x%08x of its warp wait for it at a shuffle / __syncwarp with "
         "mask 0x%08x", warp.arrived, warp.mask);
  }
}

void fiber_entry() {
  Worker& w = *t_worker;
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &w.sched_bottom, &w.sched_size);
#endif
  (*w.body)();
  on_exit(w, *w.cur);
  yield_to_scheduler(w);  // never resumed
  fail("a finished fiber was resumed");
}

// ---- shared memory poisoning

int find_tls(struct dl_phdr_info* info, size_t, void* data) {
  auto* w = static_cast<Worker*>(data);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_TLS) {
      w->tls_begin = static_cast<char*>(info->dlpi_tls_data);
      w->tls_size = info->dlpi_phdr[i].p_memsz;
    }
  }
  return 1;  // the first object is the executable
}

// Addresses as integers: the range spans many objects (UBSan's object-size check would
// otherwise attribute it to the one the pointer came from). Not instrumented: it runs at
// every block start over all of the executable's thread-locals, and a sanitizer check per
// word made it a tenth of the emulator's time; the range is the TLS segment itself.
__attribute__((no_sanitize("address", "undefined")))
void fill_words(uintptr_t begin, uintptr_t end) {
  for (uintptr_t p = begin; p + 4 <= end; p += 4) {
    memcpy(reinterpret_cast<void*>(p), &kPoisonWord, 4);
  }
}

void poison_shared(Worker& w) {
  if (w.tls_begin == nullptr) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(w.tls_begin);
  const uintptr_t end = begin + w.tls_size;
  const uintptr_t self = reinterpret_cast<uintptr_t>(&t_worker);
  if (self >= begin && self < end) {
    fill_words(begin, self);
    fill_words(self + sizeof(t_worker), end);
  } else {
    fill_words(begin, end);
  }
}

void poison_dynamic_tail(Worker& w, bool poison) {
#if EMU_ASAN
  std::lock_guard<std::mutex> lock(g_dyn_mutex);
  for (auto get : dyn_getters()) {
    char* base = static_cast<char*>(get());
    if (poison) {
      ASAN_POISON_MEMORY_REGION(base + w.smem, kMaxDynamicSmem - w.smem);
    } else {
      ASAN_UNPOISON_MEMORY_REGION(base, kMaxDynamicSmem);
    }
  }
#else
  (void)w;
  (void)poison;
#endif
}

// ---- one block

void run_block(Worker& w, int64_t linear_block) {
  const int64_t gx = w.gdim.x, gy = w.gdim.y;
  w.block = {static_cast<unsigned>(linear_block % gx),
             static_cast<unsigned>((linear_block / gx) % gy),
             static_cast<unsigned>(linear_block / (gx * gy))};
  w.at_barrier = 0;
  w.barrier_where = nullptr;
  w.exited = 0;
  for (auto& wp : w.warps) wp = Warp{};
  w.runnable.clear();
  poison_shared(w);
  poison_dynamic_tail(w, true);

  for (int i = 0; i < w.nthreads; ++i) {
    Fiber& f = w.fibers[i];
    f.linear = i;
    f.idx = {static_cast<unsigned>(i % w.bdim.x),
             static_cast<unsigned>((i / w.bdim.x) % w.bdim.y),
             static_cast<unsigned>(i / (w.bdim.x * w.bdim.y))};
    f.state = State::Runnable;
    f.fake_stack = nullptr;
    f.copies.clear();
    f.commits = 0;
#if EMU_ASAN
    // Frames of the previous block's fibers left their redzones in the shadow.
    ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackBytes);
#endif
    context_init(f.ctx, f.stack, kStackBytes, fiber_entry);
    w.runnable.push_back(i);
  }

  int done = 0;
  while (done < w.nthreads) {
    if (w.runnable.empty()) {
      std::string dump;
      for (int i = 0; i < w.nthreads; ++i) {
        const Fiber& f = w.fibers[i];
        if (f.state == State::Done) continue;
        char line[256];
        snprintf(line, sizeof line, "\n  thread %d (warp %d lane %d) %s at %s", i, i / 32,
                 i % 32, state_name(f), f.where);
        dump += line;
        if (dump.size() > 3000) {
          dump += "\n  ...";
          break;
        }
      }
      fail("deadlock: no thread can run, %d of %d exited:%s", w.exited, w.nthreads,
           dump.c_str());
    }
    size_t pick = 0;
    if (w.random) pick = static_cast<size_t>(w.rng() % w.runnable.size());
    const int id = w.runnable[pick];
    w.runnable.erase(w.runnable.begin() + static_cast<std::ptrdiff_t>(pick));
    Fiber& f = w.fibers[id];
    switch_to_fiber(w, f);
    if (f.state == State::Done) ++done;
  }
  poison_dynamic_tail(w, false);
}

struct LaunchJob {
  dim3 grid, block;
  size_t smem;
  const char* name;
  const std::function<void()>* body;
  std::vector<int64_t> order;
  std::atomic<int64_t> next{0};
};

void worker_main(LaunchJob& job, int worker_index) {
  Worker w;
  t_worker = &w;
  dl_iterate_phdr(find_tls, &w);
  w.kernel = job.name;
  w.body = job.body;
  w.bdim = job.block;
  w.gdim = job.grid;
  w.smem = job.smem;
  w.nthreads = static_cast<int>(job.block.x * job.block.y * job.block.z);
  w.fibers.resize(static_cast<size_t>(w.nthreads));
  w.warps.resize(static_cast<size_t>((w.nthreads + 31) / 32));
  const uint64_t seed = g_seed.load();
  w.random = seed != 0;
  w.rng.seed(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(worker_index) + 1);
  // One mapping for all stacks; a PROT_NONE guard page below each catches overflows.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t slot = kStackBytes + page;
  const size_t total = slot * static_cast<size_t>(w.nthreads);
  char* map = static_cast<char*>(
      mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
           -1, 0));
  if (map == MAP_FAILED) fail("mmap of %zu bytes of fiber stacks failed", total);
  for (int i = 0; i < w.nthreads; ++i) {
    char* s = map + slot * static_cast<size_t>(i);
    mprotect(s, page, PROT_NONE);
    w.fibers[i].stack = s + page;
  }
  const int64_t total_blocks = static_cast<int64_t>(job.order.size());
  for (;;) {
    const int64_t i = job.next.fetch_add(1);
    if (i >= total_blocks) break;
    run_block(w, job.order[static_cast<size_t>(i)]);
  }
#if EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(map, total);
#endif
  munmap(map, total);
  t_worker = nullptr;
}

}  // namespace

void set_schedule_seed(uint64_t seed) { g_seed.store(seed); }
uint64_t schedule_seed() { return g_seed.load(); }
void set_workers(int n) { g_workers.store(n); }

void log_kernel(const void* kernel) {
  static const char* const path = std::getenv("CUDA_EMU_KERNEL_LOG");
  if (path == nullptr) return;
  Dl_info info{};
  const char* symbol = dladdr(kernel, &info) != 0 && info.dli_sname != nullptr
                           ? info.dli_sname
                           : "?";
  static std::mutex log_mutex;
  std::lock_guard<std::mutex> lock(log_mutex);
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%s\n", symbol);
    std::fclose(f);
  }
}

bool register_dynamic_smem(void* (*get)()) {
  std::lock_guard<std::mutex> lock(g_dyn_mutex);
  dyn_getters().push_back(get);
  return true;
}

void launch_blocks(dim3 grid, dim3 block, size_t smem, const char* name,
                   const std::function<void()>& thread_body) {
  const int64_t threads = static_cast<int64_t>(block.x) * block.y * block.z;
  if (threads <= 0 || threads > 1024 || block.z > 64) {
    fail("launch of %s: invalid block (%u,%u,%u)", name, block.x, block.y, block.z);
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535u ||
      grid.z > 65535u) {
    fail("launch of %s: invalid grid (%u,%u,%u)", name, grid.x, grid.y, grid.z);
  }
  if (smem > kMaxDynamicSmem) {
    fail("launch of %s: %zu bytes of dynamic shared memory exceed the default limit of %zu",
         name, smem, kMaxDynamicSmem);
  }
  LaunchJob job;
  job.grid = grid;
  job.block = block;
  job.smem = smem;
  job.name = name;
  job.body = &thread_body;
  const int64_t nblocks = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  job.order.resize(static_cast<size_t>(nblocks));
  std::iota(job.order.begin(), job.order.end(), int64_t{0});
  const uint64_t seed = g_seed.load();
  if (seed != 0) {
    std::mt19937_64 rng(seed);
    std::shuffle(job.order.begin(), job.order.end(), rng);
  }
  int n = g_workers.load();
  if (n <= 0) {
    const char* env = getenv("CUDA_EMU_WORKERS");
    n = env != nullptr ? atoi(env) : 2;
    if (n <= 0) n = 1;
  }
  n = static_cast<int>(std::min<int64_t>(n, nblocks));
  std::vector<std::thread> pool;
  for (int i = 0; i < n; ++i) pool.emplace_back(worker_main, std::ref(job), i);
  for (auto& t : pool) t.join();
}

// ---- the device-side API (cuda_shim.h)

const uint3& thread_idx() { return worker().cur->idx; }

const uint3& block_idx() { return worker().block; }

const dim3& block_dim() { return worker().bdim; }

const dim3& grid_dim() { return worker().gdim; }

void syncthreads(const char* where) {
  Worker& w = worker();
  Fiber& f = *w.cur;
  if (w.exited > 0) {
    fail("reached __syncthreads (%s) after %d threads of the block exited: a divergent "
         "barrier (undefined behaviour in CUDA)", where, w.exited);
  }
  if (w.at_barrier > 0 && strcmp(w.barrier_where, where) != 0) {
    fail("waits at __syncthreads (%s) while %d threads wait at another one (%s)", where,
         w.at_barrier, w.barrier_where);
  }
  f.state = State::AtBarrier;
  f.where = where;
  w.barrier_where = where;
  if (++w.at_barrier == w.nthreads) {
    w.at_barrier = 0;
    for (int i = 0; i < w.nthreads; ++i) {
      if (w.fibers[i].state == State::AtBarrier) make_runnable(w, w.fibers[i]);
    }
  }
  yield_to_scheduler(w);
}

namespace {

// Deposits the calling lane at its warp's pending exchange; completes it when every lane
// of the mask is there. Returns after the exchange completed (the fiber's result is set).
const char* op_name(WarpOpKind k) {
  return k == WarpOpKind::Shfl ? "shuffle"
         : k == WarpOpKind::Syncwarp ? "__syncwarp" : "warp collective";
}

void warp_op(Worker& w, unsigned mask, const char* where, WarpOpKind kind) {
  Fiber& f = *w.cur;
  const int lane = f.linear % 32;
  const int warp_id = f.linear / 32;
  const bool is_shfl = kind == WarpOpKind::Shfl;
  const char* op = op_name(kind);
  if (!(mask >> lane & 1u)) fail("%s (%s) with mask 0x%08x that omits the calling lane %d", op, where, mask, lane);
  const int lanes_here = std::min(32, w.nthreads - warp_id * 32);
  if (lanes_here < 32 && (mask >> lanes_here) != 0) {
    fail("%s (%s) with mask 0x%08x names lanes that do not exist (warp of %d threads)", op,
         where, mask, lanes_here);
  }
  Warp& wp = w.warps[static_cast<size_t>(warp_id)];
  if (wp.arrived == 0) {
    wp.mask = mask;
  } else if (wp.mask != mask) {
    fail("%s (%s) with mask 0x%08x while lanes 0x%08x of its warp wait with mask 0x%08x", op,
         where, mask, wp.arrived, wp.mask);
  }
  for (int l = 0; l < lanes_here; ++l) {
    if ((mask >> l & 1u) && w.fibers[warp_id * 32 + l].state == State::Done) {
      fail("%s (%s) with mask 0x%08x names lane %d, which has exited", op, where, mask, l);
    }
  }
  f.state = State::AtWarpOp;
  f.where = where;
  f.op = kind;
  wp.arrived |= 1u << lane;
  if (wp.arrived == wp.mask) {
    Fiber* lanes = &w.fibers[static_cast<size_t>(warp_id) * 32];
    for (int l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u)) continue;
      Fiber& g = lanes[l];
      if (g.op != kind) {
        fail("lanes of mask 0x%08x meet at a %s and at a %s (%s, %s)", mask, op_name(g.op),
             op, g.where, where);
      }
      if (kind == WarpOpKind::Collective && g.coll_fn != f.coll_fn) {
        fail("lanes of mask 0x%08x meet at different warp-collective instructions (%s, %s)",
             mask, g.where, where);
      }
      if (is_shfl) {
        const int width = g.width;
        if (width <= 0 || width > 32 || (width & (width - 1)) != 0) {
          fail("shuffle (%s) with width %d", g.where, width);
        }
        const int seg = l & ~(width - 1);
        int src = l;
        switch (g.kind) {
          case 0: src = seg + (g.arg & (width - 1)); break;
          case 1: src = ((l ^ g.arg) < seg + width && (l ^ g.arg) >= seg) ? (l ^ g.arg) : l; break;
          case 2: src = (l - g.arg >= seg) ? l - g.arg : l; break;
          case 3: src = (l + g.arg < seg + width) ? l + g.arg : l; break;
        }
        if (src < 0 || src >= 32 || !(mask >> src & 1u)) {
          fail("lane %d's shuffle (%s) reads lane %d, which is not in mask 0x%08x (undefined "
               "value in CUDA)", l, g.where, src, mask);
        }
        g.result = lanes[src].value;
      }
    }
    if (kind == WarpOpKind::Collective) {
      void* data[32] = {};
      for (int l = 0; l < 32; ++l) data[l] = (mask >> l & 1u) ? lanes[l].coll_data : nullptr;
      f.coll_fn(data);
    }
    wp.arrived = 0;
    for (int l = 0; l < 32; ++l) {
      if (mask >> l & 1u) make_runnable(w, lanes[l]);
    }
  }
  yield_to_scheduler(w);
}

}  // namespace

void syncwarp(unsigned mask, const char* where) {
  warp_op(worker(), mask, where, WarpOpKind::Syncwarp);
}

uint64_t shfl(unsigned mask, uint64_t value, int kind, int arg, int width, const char* where) {
  Worker& w = worker();
  Fiber& f = *w.cur;
  f.value = value;
  f.kind = kind;
  f.arg = arg;
  f.width = width;
  warp_op(w, mask, where, WarpOpKind::Shfl);
  return f.result;
}

void warp_collective(void* lane_data, WarpCollectiveFn fn, const char* where) {
  Worker& w = worker();
  Fiber& f = *w.cur;
  if (w.nthreads % 32 != 0) {
    fail("warp collective (%s) in a block of %d threads (not whole warps)", where, w.nthreads);
  }
  f.coll_fn = fn;
  f.coll_data = lane_data;
  warp_op(w, 0xffffffffu, where, WarpOpKind::Collective);
}

bool is_shared(const void* p, size_t bytes) {
  const Worker& w = worker();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(w.tls_begin);
  return w.tls_begin != nullptr && a >= begin && a + bytes <= begin + w.tls_size;
}

int lane_id() { return worker().cur->linear % 32; }

void error(const char* msg) { fail("%s", msg); }

void cp_async(void* dst, const void* src, int bytes, int src_bytes, const char* where) {
  Worker& w = worker();
  Fiber& f = *w.cur;
  if (bytes != 4 && bytes != 8 && bytes != 16) fail("cp.async (%s) of %d bytes", where, bytes);
  if (src_bytes < 0 || src_bytes > bytes) {
    fail("cp.async (%s): src-size %d outside [0, %d]", where, src_bytes, bytes);
  }
  if (!is_shared(dst, static_cast<size_t>(bytes))) {
    fail("cp.async (%s): destination %p is not shared memory", where, dst);
  }
  if (reinterpret_cast<uintptr_t>(dst) % static_cast<uintptr_t>(bytes) != 0 ||
      reinterpret_cast<uintptr_t>(src) % static_cast<uintptr_t>(bytes) != 0) {
    fail("cp.async (%s) of %d bytes: misaligned address (dst %p, src %p)", where, bytes, dst,
         src);
  }
  PendingCopy c{};
  c.dst = static_cast<char*>(dst);
  c.bytes = bytes;
  c.group = f.commits;
  c.where = where;
  // The source is read now (ASan checks it here, at the issuing line); the destination
  // is written only when a wait completes the copy's group.
  if (src_bytes > 0) memcpy(c.data, src, static_cast<size_t>(src_bytes));
  f.copies.push_back(c);
}

void cp_async_commit() {
  Worker& w = worker();
  ++w.cur->commits;
}

void cp_async_wait(int pending) {
  Worker& w = worker();
  Fiber& f = *w.cur;
  if (pending < 0) fail("cp.async.wait_group %d", pending);
  // Complete every committed group but the `pending` most recent ones; copies not yet
  // committed belong to no group and stay in flight.
  const uint64_t done_below =
      f.commits >= static_cast<uint64_t>(pending) ? f.commits - static_cast<uint64_t>(pending) : 0;
  std::vector<PendingCopy> keep;
  for (const PendingCopy& c : f.copies) {
    if (c.group < done_below) {
      memcpy(c.dst, c.data, static_cast<size_t>(c.bytes));
    } else {
      keep.push_back(c);
    }
  }
  f.copies.swap(keep);
}

}  // namespace cuda_emu
