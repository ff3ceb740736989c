// CPU paged-attention kernel body, compiled once per instruction set: each
// attention_<isa>.cpp sets its target and VLLM_LITE_ISA_FN, then includes this file. Plain
// loops over fixed-width lane arrays let the compiler vectorize for that target (SSE2/NEON
// for generic, AVX2+FMA, AVX-512) with no intrinsics, so every build stays portable.
//
// Layouts: the split layout (vLLM v0.6): key_cache [num_blocks, num_kv_heads, head_size /
// x, block_size, x] with x = 16 bytes / cache element; value_cache [num_blocks,
// num_kv_heads, head_size, block_size]. The flash layout (p.flash_layout): both [num_blocks,
// block_size, num_kv_heads, head_size], a token's head_size elements contiguous (the K pass
// then folds VW tokens' per-lane dot products as the split layout's does with x lanes, and
// the V pass keeps dims across the lanes). query [num_seqs, num_heads, head_size] (strided
// rows allowed).
// Cache elements: the query's dtype, or fp8 (e4m3fn / e5m2 bytes, x = 16) holding
// key / k_scale and value / v_scale: converted exactly to float32 as they are loaded, with
// k_scale folded into the query and v_scale into the output.
//
// Grid: one task per (sequence, KV head, partition of partition_size tokens); the caller
// runs tasks in parallel. A task serves all num_heads / num_kv_heads query heads of its KV
// head, so each K/V block of the partition is read from memory once (GQA/MQA):
//   1. K pass: VW tokens at a time, tokens across lane groups (key_vectors: one load serves
//      several tokens, no per-token horizontal sum); a run's last < VW tokens one at a
//      time (the key in float32 in an L1 buffer, then the dot products of all query heads)
//      -> logits [group, partition_size] in scratch. Meanwhile prefetch the next block's K
//      tile and this block's V tile (blocks are scattered).
//   2. Softmax per head: max, exp (a branchless polynomial that vectorizes), sum; logits
//      become probabilities.
//   3. V pass: value rows are token-contiguous, so for each dim accumulate p * v with
//      tokens across the lanes, four heads' accumulators in registers, and reduce lanes
//      once per (head, dim).
// Vectors are VLLM_LITE_VEC_WIDTH floats wide, the target's native width (4, 8 or 16).
// Output per (seq, head, partition): max logit, exp sum, normalized output (float32), which
// attention.cpp combines across partitions. Limits (attention_limits.h): head_size a
// multiple of 8 up to kMaxHeadSize (256), any block size, up to kMaxQueryHeadsPerKvHead
// (64) query heads per KV head, partitions of at most kPartitionSize (512) tokens.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_limits.h"
#include "cpu/attention_params.h"
#include "cpu/vec.h"

#ifndef VLLM_LITE_ISA_FN
#error "define VLLM_LITE_ISA_FN before including attention_kernel.h"
#endif

namespace vllm_lite::cpu {
// Internal linkage: this ISA's copies of these functions never merge with another build's.
namespace {
template <KvDType DT>
struct Elem;
template <>
struct Elem<KvDType::kFloat32> {
  using T = float;
  VLLM_LITE_INLINE static float to_float(float v) { return v; }
  template <int64_t N>
  VLLM_LITE_INLINE static Vec<float, N> load(const float* p) {
    return load_vec<Vec<float, N>>(p);
  }
};

template <>
struct Elem<KvDType::kFloat16> {
  using T = uint16_t;
  VLLM_LITE_INLINE static float to_float(uint16_t v) { return half_to_float(v); }
  template <int64_t N>
  VLLM_LITE_INLINE static Vec<float, N> load(const uint16_t* p) {
    return half_lanes_to_float<N>(
        __builtin_convertvector(load_vec<Vec<uint16_t, N>>(p), Vec<uint32_t, N>));
  }
};

// fp8 e4m3fn -> float, exact and branchless (so it vectorizes): exponent field 0 is
// subnormal (m * 2^-9), S.1111.111 is NaN, everything else 2^(e - 7) * (1 + m / 8). The
// caller multiplies by the cache's scale.
template <>
struct Elem<KvDType::kFp8E4M3> {
  using T = uint8_t;
  VLLM_LITE_INLINE static float to_float(uint8_t v) {
    const uint32_t em = v & 0x7fu;
    uint32_t bits = (em << 20) + ((127u - 7u) << 23);
    bits = em == 0x7fu ? 0x7fc00000u : bits;
    bits = em < 0x8u ? float_to_bits(static_cast<float>(em) * 0.001953125f) : bits;
    return bits_to_float(bits | (static_cast<uint32_t>(v & 0x80u) << 24));
  }
  template <int64_t N>
  VLLM_LITE_INLINE static Vec<float, N> load(const uint8_t* p) {
    using U = Vec<uint32_t, N>;
    const U b = __builtin_convertvector(load_vec<Vec<uint8_t, N>>(p), U);
    const U em = b & 0x7fu;
    U bits = (em << 20) + ((127u - 7u) << 23);
    bits = em == 0x7fu ? U{} + 0x7fc00000u : bits;
    const Vec<float, N> sub = __builtin_convertvector(em, Vec<float, N>) * 0.001953125f;
    bits = em < 0x8u ? (U)sub : bits;
    return (Vec<float, N>)(bits | ((b & 0x80u) << 24));
  }
};

// fp8 e5m2 is the high byte of an IEEE half.
template <>
struct Elem<KvDType::kFp8E5M2> {
  using T = uint8_t;
  VLLM_LITE_INLINE static float to_float(uint8_t v) {
    return half_to_float(static_cast<uint16_t>(v << 8));
  }
  template <int64_t N>
  VLLM_LITE_INLINE static Vec<float, N> load(const uint8_t* p) {
    return half_lanes_to_float<N>(
        __builtin_convertvector(load_vec<Vec<uint8_t, N>>(p), Vec<uint32_t, N>) << 8);
  }
};

// One query row in float32 times `scale`, whatever the query's dtype (read once per task,
// so a runtime switch costs nothing).
VLLM_LITE_INLINE void load_query_row(KvDType dt, const void* row, int64_t n, float scale,
                                     float* dst) {
  switch (dt) {
    case KvDType::kFloat32:
      for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<const float*>(row)[d] * scale;
      return;
    case KvDType::kFloat16:
      for (int64_t d = 0; d < n; ++d) {
        dst[d] = half_to_float(static_cast<const uint16_t*>(row)[d]) * scale;
      }
      return;
    default:  // bfloat16 (validate.cpp allows no other query dtype)
      for (int64_t d = 0; d < n; ++d) {
        dst[d] = bits_to_float(static_cast<uint32_t>(static_cast<const uint16_t*>(row)[d]) << 16) *
                 scale;
      }
      return;
  }
}
template <>
struct Elem<KvDType::kBFloat16> {
  using T = uint16_t;
  VLLM_LITE_INLINE static float to_float(uint16_t v) { return bits_to_float(static_cast<uint32_t>(v) << 16); }
  template <int64_t N>
  VLLM_LITE_INLINE static Vec<float, N> load(const uint16_t* p) {
    using U = Vec<uint32_t, N>;
    const U w = __builtin_convertvector(load_vec<Vec<uint16_t, N>>(p), U) << 16;
    return (Vec<float, N>)w;
  }
};

// Blocks sit at random places in the pool, beyond the reach of the hardware prefetcher:
// fetch the next block's tile of this KV head while working on the current one. Locality 1
// (prefetcht2: into the outer caches, not L1): a core has few L1 miss buffers, and with
// prefetcht0 the ~16 KiB in flight queued on them; into L2 the same prefetches ran the
// decode kernel clearly faster on a KV pool far larger than the caches (docs/results/
// kernels.md has the figures). The K pass's loads then hit L2.
VLLM_LITE_INLINE void prefetch_tile(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 1);
}

// Floats per native vector of this build's target (set by the including file).
constexpr int64_t VW = VLLM_LITE_VEC_WIDTH;
using FV = Vec<float, VW>;

// Keeps the K tiles of the next blocks in flight: one block ahead is too little to hide
// memory latency when every block sits somewhere else in the pool, so prefetch about
// 16 KiB ahead.
struct KeyPrefetcher {
  const void* base;
  const int32_t* table;
  int64_t block_stride_bytes;
  int64_t tile_bytes;
  int64_t last_block;  // logical index of the partition's last block
  int64_t distance;    // blocks ahead
  bool flash;          // the tile's layout (prefetch_kv_tile)
  int64_t D, bs, kv_heads, elem;

  KeyPrefetcher(const void* b, const int32_t* t, int64_t stride_bytes, int64_t tile,
                int64_t first_block, int64_t last, bool flash_layout, int64_t head_size,
                int64_t block_size, int64_t num_kv_heads, int64_t elem_bytes)
      : base(b), table(t), block_stride_bytes(stride_bytes), tile_bytes(tile), last_block(last),
        flash(flash_layout), D(head_size), bs(block_size), kv_heads(num_kv_heads),
        elem(elem_bytes) {
    const int64_t d = 16384 / tile;
    distance = d < 1 ? 1 : (d > 16 ? 16 : d);
    for (int64_t k = 1; k < distance && first_block + k <= last_block; ++k) fetch(first_block + k);
  }
  VLLM_LITE_INLINE void fetch(int64_t logical) const {
    const char* tile = static_cast<const char*>(base) + table[logical] * block_stride_bytes;
    if (!flash) return prefetch_tile(tile, tile_bytes);
    prefetch_kv_tile(tile, true, D, bs, kv_heads, elem);
  }
  // Call once per block, with that block's logical index.
  VLLM_LITE_INLINE void step(int64_t logical) const {
    if (logical + distance <= last_block) fetch(logical + distance);
  }
};

VLLM_LITE_INLINE float hsum(Vec<float, 4> v) { return (v[0] + v[2]) + (v[1] + v[3]); }
VLLM_LITE_INLINE float hsum(Vec<float, 8> v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
VLLM_LITE_INLINE float hsum(Vec<float, 16> v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// dot(q_g, k) for NG query heads at once: k is loaded once per vector for all of them, and
// the NG independent accumulators hide the FMA latency.
template <int64_t NG>
VLLM_LITE_INLINE void dots(const float* q, int64_t q_stride, const float* k, int64_t n, float* out,
                           int64_t out_stride) {
  FV acc[NG] = {};
  for (int64_t i = 0; i < n; i += VW) {
    const FV kv = load_vec<FV>(k + i);
    for (int64_t g = 0; g < NG; ++g) acc[g] += load_vec<FV>(q + g * q_stride + i) * kv;
  }
  for (int64_t g = 0; g < NG; ++g) out[g * out_stride] = hsum(acc[g]);
}

// The K pass over whole vectors of tokens. In the key cache, a chunk of X elements of
// consecutive tokens is contiguous ([head_size / X, block_size, X] per block), so one
// vector holds the same LPT = min(X, VW) dims of TPV = VW / LPT tokens. Multiplied by the
// query's LPT dims repeated TPV times and summed over the head's vectors, it leaves each
// token's dot product spread over its LPT lanes; LPT such accumulators (VW tokens) fold
// into one vector of VW logits by log2(LPT) rounds of adjacent-pair sums. A dot product
// per token (dots) instead ends in a horizontal sum per token and head, which at head
// size 64 cost more than the token's FMAs.
template <int64_t X>
constexpr int64_t key_lanes() { return X < VW ? X : VW; }
// Query heads per key_vectors call: LPT x heads accumulators, the heads' query vectors and
// a key vector must fit the register file (32 vectors with AVX-512, else 16).
template <int64_t X>
constexpr int64_t key_heads() {
  constexpr int64_t n = (VW >= 16 ? 24 : 12) / (key_lanes<X>() + 1);
  return n < 1 ? 1 : (n > 4 ? 4 : n);
}

// a's adjacent-pair sums, then b's: (a0 + a1, a2 + a3, ..., b0 + b1, ...). A template, so
// builds with narrower vectors never instantiate the wide shuffles.
template <int64_t N>
VLLM_LITE_INLINE Vec<float, N> pair_sums(Vec<float, N> a, Vec<float, N> b) {
  if constexpr (N == 4) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6) + __builtin_shufflevector(a, b, 1, 3, 5, 7);
  } else if constexpr (N == 8) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
  } else {
    static_assert(N == 16, "vectors of 4, 8 or 16 floats");
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                   30) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                   31);
  }
}

// The query rows as key_vectors reads them: head g's dims [i * LPT, (i + 1) * LPT) repeated
// TPV times in vector i of qrep + g * D * TPV (D / LPT vectors per head).
template <int64_t X>
VLLM_LITE_INLINE void repeat_query(const float* q, int64_t q_stride, int64_t G, int64_t D,
                                   float* qrep) {
  constexpr int64_t LPT = key_lanes<X>();
  static_assert(VW / LPT <= 4, "attention_scratch_floats has room for 4 copies of q");
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < D / LPT; ++i) {
      for (int64_t l = 0; l < VW; ++l) {
        qrep[(g * (D / LPT) + i) * VW + l] = q[g * q_stride + i * LPT + l % LPT];
      }
    }
  }
}

// lg[g * lg_stride + i] = dot(q_g, key of token i) for the VW consecutive tokens from kt
// (their chunk 0 in a block's key tile, bs tokens per chunk row) and NG query heads, whose
// repeat_query vectors start at qrep.
template <typename E, int64_t NG>
VLLM_LITE_INLINE void key_vectors(const typename E::T* kt, int64_t bs, int64_t D,
                                  const float* qrep, float* lg, int64_t lg_stride) {
  constexpr int64_t X = 16 / sizeof(typename E::T);
  constexpr int64_t LPT = key_lanes<X>();
  constexpr int64_t TPV = VW / LPT;
  const int64_t nv = D / LPT;  // query vectors per head
  FV acc[LPT][NG] = {};
  for (int64_t c = 0; c < D / X; ++c) {
    for (int64_t j = 0; j < X; j += LPT) {
      FV qv[NG];
      const int64_t i = (c * X + j) / LPT;
      for (int64_t g = 0; g < NG; ++g) qv[g] = load_vec<FV>(qrep + (g * nv + i) * VW);
      for (int64_t u = 0; u < LPT; ++u) {
        const FV kv = E::template load<VW>(kt + (c * bs + u * TPV) * X + j);
        for (int64_t g = 0; g < NG; ++g) acc[u][g] += qv[g] * kv;
      }
    }
  }
  for (int64_t g = 0; g < NG; ++g) {
    FV r[LPT];
    for (int64_t u = 0; u < LPT; ++u) r[u] = acc[u][g];
    for (int64_t w = LPT; w > 1; w /= 2) {
      for (int64_t i = 0; i < w / 2; ++i) r[i] = pair_sums<VW>(r[2 * i], r[2 * i + 1]);
    }
    store_vec(lg + g * lg_stride, r[0]);
  }
}

// key_vectors for all G query heads, key_heads() at a time.
template <typename E>
VLLM_LITE_INLINE void key_vectors_all(const typename E::T* kt, int64_t bs, int64_t D, int64_t G,
                                      const float* qrep, float* lg, int64_t lg_stride) {
  constexpr int64_t HG = key_heads<16 / sizeof(typename E::T)>();
  const int64_t qs = D * VW / key_lanes<16 / sizeof(typename E::T)>();  // floats per head
  int64_t g = 0;
  for (; g + HG <= G; g += HG) {
    key_vectors<E, HG>(kt, bs, D, qrep + g * qs, lg + g * lg_stride, lg_stride);
  }
  const int64_t rest = G - g;
  const float* qr = qrep + g * qs;
  float* lr = lg + g * lg_stride;
  if constexpr (HG > 3) {
    if (rest == 3) return key_vectors<E, 3>(kt, bs, D, qr, lr, lg_stride);
  }
  if constexpr (HG > 2) {
    if (rest == 2) return key_vectors<E, 2>(kt, bs, D, qr, lr, lg_stride);
  }
  if constexpr (HG > 1) {
    if (rest == 1) return key_vectors<E, 1>(kt, bs, D, qr, lr, lg_stride);
  }
}

// Lane-wise max of n floats (n >= 1): vectorizes where a scalar running max cannot.
VLLM_LITE_INLINE float max_of(const float* x, int64_t n) {
  FV m = FV{} + x[0];
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    const FV v = load_vec<FV>(x + i);
    m = v > m ? v : m;
  }
  float r = m[0];
  for (int64_t l = 1; l < VW; ++l) r = m[l] > r ? m[l] : r;
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

// Runs of one partition: partition_size (== kPartitionSize, set by attention.cpp) tokens
// at one token per block at worst.
constexpr int64_t kMaxRuns = kPartitionSize;
// The partition as runs of consecutive tokens within one block: where each run's V tile
// starts for this KV head, its first token within the partition, and its length.
template <typename T>
struct Runs {
  const T* tile[kMaxRuns];
  int64_t first[kMaxRuns];
  int64_t len[kMaxRuns];
  int64_t count;
};
static_assert(std::extent_v<decltype(Runs<float>::first)> >= kPartitionSize,
              "a partition of block-size-1 blocks has kPartitionSize runs");

// Per-head pointers of one task (softmax's probs / outs): one per query head of a KV head.
constexpr int64_t kMaxGroup = kMaxQueryHeadsPerKvHead;

// One task's place in the grid and the geometry of its KV head's tiles.
template <typename T>
struct Task {
  int64_t s, kh, part;      // sequence, KV head, partition
  int64_t len, start, end;  // the sequence's length; the partition's tokens [start, end)
  int64_t G, h0;            // query heads of the KV head, and the first of them
  int64_t D, bs;
  const int32_t* table;     // the sequence's block table
  int64_t block_stride;     // elements between blocks of the cache
  bool flash;               // the caches' layout (AttentionParams::flash_layout)
  int64_t ts;               // flash layout: elements between a tile's tokens
  int64_t kv_heads;
  const T* kc;              // this KV head's tile in block 0 of each cache
  const T* vc;
  int64_t tile_bytes;       // one (block, KV head) tile

  Task(const AttentionParams& p, int64_t task)
      : s(task / (p.num_partitions * p.num_kv_heads)),
        kh((task / p.num_partitions) % p.num_kv_heads),
        part(task % p.num_partitions),
        len(p.seq_lens[s]),
        start(part * p.partition_size),
        end(len < start + p.partition_size ? len : start + p.partition_size),
        G(p.num_heads / p.num_kv_heads),
        h0(kh * G),
        D(p.head_size),
        bs(p.block_size),
        table(p.block_tables + s * p.max_blocks_per_seq),
        block_stride(p.num_kv_heads * p.head_size * p.block_size),
        flash(p.flash_layout),
        ts(kv_flash_token_stride(p.num_kv_heads, p.head_size)),
        kv_heads(p.num_kv_heads),
        kc(static_cast<const T*>(p.key_cache) + kv_head_offset(flash, kh, D, bs)),
        vc(static_cast<const T*>(p.value_cache) + kv_head_offset(flash, kh, D, bs)),
        tile_bytes(D * bs * static_cast<int64_t>(sizeof(T))) {}
  bool empty() const { return start >= len; }
  int64_t n() const { return end - start; }
};

// Walks the partition block by block for the K pass: keeps K tiles ~16 KiB ahead in
// flight, prefetches each block's V tile for the V pass, records the V runs, and calls
// key_block(key tile of the block, first token's offset in the block, token count, index
// of that token in the partition).
template <typename T, typename KeyBlock>
VLLM_LITE_INLINE void walk_blocks(const Task<T>& k, Runs<T>& runs, KeyBlock&& key_block) {
  runs.count = 0;
  constexpr int64_t elem = static_cast<int64_t>(sizeof(T));
  const KeyPrefetcher kpf(k.kc, k.table, k.block_stride * elem, k.tile_bytes, k.start / k.bs,
                          (k.end - 1) / k.bs, k.flash, k.D, k.bs, k.kv_heads, elem);
  for (int64_t t = k.start; t < k.end;) {
    const int64_t block = k.table[t / k.bs];
    const int64_t off = t % k.bs;
    const int64_t cnt = k.bs - off < k.end - t ? k.bs - off : k.end - t;
    kpf.step(t / k.bs);
    if (k.flash) {
      prefetch_kv_tile(k.vc + block * k.block_stride, true, k.D, k.bs, k.kv_heads, elem);
    } else {
      prefetch_tile(k.vc + block * k.block_stride, k.tile_bytes);
    }
    // The run's first value: its row in the flash layout, its dim-0 element in the split.
    runs.tile[runs.count] = k.vc + block * k.block_stride + off * (k.flash ? k.ts : 1);
    runs.first[runs.count] = t - k.start;
    runs.len[runs.count++] = cnt;
    key_block(k.kc + block * k.block_stride, off, cnt, t - k.start);
    t += cnt;
  }
}

// Dims per step of the V pass: NG x DD accumulators must fit the register file.
constexpr int64_t DD = VW >= 16 ? 4 : 2;

// The V pass for NG query heads (compile-time, so their accumulators live in registers):
// out[g, d] = sum_t p[g, t] * V[t, d]. For DD dims at a time it walks the partition's runs
// with tokens across the lanes: whole vectors first, then each run's partial vector, so
// the hot loop has no tail handling. The V tiles were prefetched during the K pass.
template <typename E, int64_t NG>
VLLM_LITE_INLINE void value_pass(const Runs<typename E::T>& runs, int64_t bs, int64_t D,
                                 const float* const* probs, float* const* outs, float v_scale) {
  using T = typename E::T;
  for (int64_t d = 0; d < D; d += DD) {
    FV acc[NG][DD] = {};
    for (int64_t r = 0; r < runs.count; ++r) {
      const T* row = runs.tile[r] + d * bs;
      const int64_t i0 = runs.first[r];
      const int64_t full = runs.len[r] / VW * VW;
      for (int64_t i = 0; i < full; i += VW) {
        FV v[DD];
        for (int64_t k = 0; k < DD; ++k) v[k] = E::template load<VW>(row + k * bs + i);
        for (int64_t g = 0; g < NG; ++g) {
          const FV pg = load_vec<FV>(probs[g] + i0 + i);
          for (int64_t k = 0; k < DD; ++k) acc[g][k] += pg * v[k];
        }
      }
    }
    for (int64_t r = 0; r < runs.count; ++r) {
      const int64_t full = runs.len[r] / VW * VW;
      const int64_t rem = runs.len[r] - full;
      if (rem == 0) continue;
      // A partial vector: never read past the run's last token (it may end the pool).
      const T* row = runs.tile[r] + d * bs + full;
      const int64_t i0 = runs.first[r] + full;
      for (int64_t k = 0; k < DD; ++k) {
        float tail[VW] = {};
        for (int64_t l = 0; l < rem; ++l) tail[l] = E::to_float(row[k * bs + l]);
        const FV v = load_vec<FV>(tail);
        for (int64_t g = 0; g < NG; ++g) {
          float pt[VW] = {};
          for (int64_t l = 0; l < rem; ++l) pt[l] = probs[g][i0 + l];
          acc[g][k] += load_vec<FV>(pt) * v;
        }
      }
    }
    for (int64_t g = 0; g < NG; ++g) {
      for (int64_t k = 0; k < DD; ++k) outs[g][d + k] = hsum(acc[g][k]) * v_scale;
    }
  }
}

// Softmax over one partition's logits [G, partition_size] (G = the KV head's query heads,
// from h0): adds ALiBi, records each head's max logit and exp sum, turns the logits into
// probabilities in place, and points probs/outs at each head's row and output.
VLLM_LITE_INLINE void softmax(const AttentionParams& p, int64_t s, int64_t part, int64_t h0,
                              int64_t start, int64_t n, float* logits, const float** probs,
                              float** outs) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t len = p.seq_lens[s];
  for (int64_t g = 0; g < G; ++g) {
    float* lg = logits + g * p.partition_size;
    if (p.alibi_slopes != nullptr) {
      const float slope = p.alibi_slopes[h0 + g];
      for (int64_t i = 0; i < n; ++i) lg[i] += slope * static_cast<float>(start + i - len + 1);
    }
    const float m = max_of(lg, n);
    // Lane-wise sums (a scalar running sum would keep the loop from vectorizing); the
    // slots past n are zeroed first so whole vectors can be read.
    const int64_t nv = (n + VW - 1) / VW * VW;
    for (int64_t i = n; i < nv; ++i) lg[i] = -87.0f + m;
    FV acc = {};
    for (int64_t i = 0; i < nv; i += VW) {
      const FV e = exp_nonpositive<FV, Vec<int32_t, VW>>(load_vec<FV>(lg + i) - m);
      store_vec(lg + i, e);
      acc += e;
    }
    for (int64_t i = n; i < nv; ++i) acc[0] -= lg[i];
    for (int64_t i = n; i < nv; ++i) lg[i] = 0.0f;
    const float sum = hsum(acc);
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; ++i) lg[i] *= inv;
    const int64_t idx = (s * p.num_heads + h0 + g) * p.num_partitions + part;
    p.part_max[idx] = m;
    p.part_sum[idx] = sum;
    probs[g] = lg;
    outs[g] = p.part_out + idx * p.head_size;
  }
}

// The flash layout's K pass over VW consecutive tokens of a block (from kt, ts elements
// apart): a token's dims are contiguous, so each of its vectors holds VW dims of one token;
// VW per-token accumulators fold into one vector of VW logits as key_vectors' do (LPT =
// VW). Needs head_size % VW == 0. q: NG query heads' rows (q_stride floats apart).
template <typename E, int64_t NG>
VLLM_LITE_INLINE void key_rows(const typename E::T* kt, int64_t ts, int64_t D, const float* q,
                               int64_t q_stride, float* lg, int64_t lg_stride) {
  FV acc[VW][NG] = {};
  for (int64_t i = 0; i < D; i += VW) {
    FV qv[NG];
    for (int64_t g = 0; g < NG; ++g) qv[g] = load_vec<FV>(q + g * q_stride + i);
    for (int64_t u = 0; u < VW; ++u) {
      const FV kv = E::template load<VW>(kt + u * ts + i);
      for (int64_t g = 0; g < NG; ++g) acc[u][g] += qv[g] * kv;
    }
  }
  for (int64_t g = 0; g < NG; ++g) {
    FV r[VW];
    for (int64_t u = 0; u < VW; ++u) r[u] = acc[u][g];
    for (int64_t w = VW; w > 1; w /= 2) {
      for (int64_t i = 0; i < w / 2; ++i) r[i] = pair_sums<VW>(r[2 * i], r[2 * i + 1]);
    }
    store_vec(lg + g * lg_stride, r[0]);
  }
}

// key_rows for all G query heads, key_heads<VW>() at a time.
template <typename E>
VLLM_LITE_INLINE void key_rows_all(const typename E::T* kt, int64_t ts, int64_t D, int64_t G,
                                   const float* q, int64_t q_stride, float* lg,
                                   int64_t lg_stride) {
  constexpr int64_t HG = key_heads<VW>();
  int64_t g = 0;
  for (; g + HG <= G; g += HG) {
    key_rows<E, HG>(kt, ts, D, q + g * q_stride, q_stride, lg + g * lg_stride, lg_stride);
  }
  for (; g < G; ++g) {
    key_rows<E, 1>(kt, ts, D, q + g * q_stride, q_stride, lg + g * lg_stride, lg_stride);
  }
}

// The flash layout's V pass for NG query heads and NV vectors of dims from d: out[g, d..] =
// sum_t p[g, t] * V[t, d..], dims across the lanes (a token's values are contiguous), so no
// lane reduction is needed.
template <typename E, int64_t NG, int64_t NV>
VLLM_LITE_INLINE void value_rows_block(const Runs<typename E::T>& runs, int64_t ts, int64_t d,
                                       const float* const* probs, float* const* outs,
                                       float v_scale) {
  FV acc[NG][NV] = {};
  for (int64_t r = 0; r < runs.count; ++r) {
    const typename E::T* row = runs.tile[r] + d;
    const int64_t i0 = runs.first[r];
    for (int64_t i = 0; i < runs.len[r]; ++i) {
      FV v[NV];
      for (int64_t j = 0; j < NV; ++j) v[j] = E::template load<VW>(row + i * ts + j * VW);
      for (int64_t g = 0; g < NG; ++g) {
        const FV pg = FV{} + probs[g][i0 + i];
        for (int64_t j = 0; j < NV; ++j) acc[g][j] += pg * v[j];
      }
    }
  }
  for (int64_t g = 0; g < NG; ++g) {
    for (int64_t j = 0; j < NV; ++j) store_vec(outs[g] + d + j * VW, acc[g][j] * v_scale);
  }
}

template <typename E, int64_t NG>
VLLM_LITE_INLINE void value_rows(const Runs<typename E::T>& runs, int64_t ts, int64_t D,
                                 const float* const* probs, float* const* outs, float v_scale) {
  int64_t d = 0;
  for (; d + 2 * VW <= D; d += 2 * VW) {
    value_rows_block<E, NG, 2>(runs, ts, d, probs, outs, v_scale);
  }
  for (; d + VW <= D; d += VW) value_rows_block<E, NG, 1>(runs, ts, d, probs, outs, v_scale);
  for (; d < D; ++d) {  // head_size % VW dims (a multiple of 8 on a 16-float build)
    for (int64_t g = 0; g < NG; ++g) {
      float acc = 0.0f;
      for (int64_t r = 0; r < runs.count; ++r) {
        for (int64_t i = 0; i < runs.len[r]; ++i) {
          acc += probs[g][runs.first[r] + i] * E::to_float(runs.tile[r][i * ts + d]);
        }
      }
      outs[g][d] = acc * v_scale;
    }
  }
}

template <KvDType DT, bool Flash>
void attention_task(const AttentionParams& p, int64_t task, float* scratch) {
  using E = Elem<DT>;
  using T = typename E::T;
  constexpr int64_t X = 16 / sizeof(T);    // key cache chunk
  constexpr int64_t CW = X < VW ? X : VW;  // conversion width for a chunk

  const Task<T> k(p, task);
  if (k.empty()) return;
  const int64_t G = k.G, D = k.D, P = p.partition_size;
  const int64_t Dp = padded_head_size(D);

  // Scratch layout (attention_scratch_floats): q [G, Dp] | kbuf [Dp] | logits [G, P] |
  // (room for the bf16 task's buffers) | qrep [G, D * TPV] (repeat_query).
  float* q = scratch;
  float* kbuf = q + G * Dp;
  float* logits = kbuf + Dp;
  float* qrep = logits + 2 * G * P + 2 * G * Dp;

  const int64_t q_elem = p.q_dtype == KvDType::kFloat32 ? 4 : 2;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t off = k.s * p.q_stride_seq + (k.h0 + g) * p.q_stride_head;
    load_query_row(p.q_dtype, static_cast<const char*>(p.query) + off * q_elem, D, p.scale,
                   q + g * Dp);
    for (int64_t d = D; d < Dp; ++d) q[g * Dp + d] = 0.0f;
  }
  for (int64_t d = D; d < Dp; ++d) kbuf[d] = 0.0f;
  // key_vectors needs VW tokens in one block run: none with blocks smaller than that.
  if (!Flash && k.bs >= VW) repeat_query<X>(q, Dp, G, D, qrep);
  // key_rows needs whole vectors of dims too.
  const int64_t vec_tokens = !Flash || D % VW == 0 ? VW : k.bs + 1;

  // 1. K pass: VW tokens at a time where the run has them (key_vectors); the rest per
  // token: its key in float32, then every head's dot product.
  Runs<T> runs;
  walk_blocks(k, runs, [&](const T* kblk, int64_t off, int64_t cnt, int64_t first) {
    int64_t i0 = 0;
    for (; i0 + vec_tokens <= cnt; i0 += VW) {
      if constexpr (Flash) {
        key_rows_all<E>(kblk + (off + i0) * k.ts, k.ts, D, G, q, Dp, logits + first + i0, P);
      } else {
        key_vectors_all<E>(kblk + (off + i0) * X, k.bs, D, G, qrep, logits + first + i0, P);
      }
    }
    for (int64_t i = i0; i < cnt; ++i) {
      if constexpr (Flash) {
        const T* kt = kblk + (off + i) * k.ts;
        int64_t j = 0;
        for (; j + VW <= D; j += VW) store_vec(kbuf + j, E::template load<VW>(kt + j));
        for (; j < D; ++j) kbuf[j] = E::to_float(kt[j]);
      } else {
        const T* kt = kblk + (off + i) * X;
        for (int64_t c = 0; c < D / X; ++c) {
          for (int64_t j = 0; j < X; j += CW) {
            store_vec(kbuf + c * X + j, E::template load<CW>(kt + c * k.bs * X + j));
          }
        }
      }
      float* lg = logits + first + i;
      int64_t g = 0;
      for (; g + 4 <= G; g += 4) dots<4>(q + g * Dp, Dp, kbuf, Dp, lg + g * P, P);
      switch (G - g) {
        case 3: dots<3>(q + g * Dp, Dp, kbuf, Dp, lg + g * P, P); break;
        case 2: dots<2>(q + g * Dp, Dp, kbuf, Dp, lg + g * P, P); break;
        case 1: dots<1>(q + g * Dp, Dp, kbuf, Dp, lg + g * P, P); break;
        default: break;
      }
    }
  });

  // 2. Softmax; logits become probabilities.
  float* outs[kMaxGroup];  // G <= kMaxQueryHeadsPerKvHead (validate.cpp)
  const float* probs[kMaxGroup];
  softmax(p, k.s, k.part, k.h0, k.start, k.n(), logits, probs, outs);

  // 3. V pass, four heads at a time (then the remainder).
  int64_t g = 0;
  if constexpr (Flash) {
    for (; g + 4 <= G; g += 4) value_rows<E, 4>(runs, k.ts, D, probs + g, outs + g, p.v_scale);
    for (; g < G; ++g) value_rows<E, 1>(runs, k.ts, D, probs + g, outs + g, p.v_scale);
    return;
  }
  for (; g + 4 <= G; g += 4) value_pass<E, 4>(runs, k.bs, D, probs + g, outs + g, p.v_scale);
  switch (G - g) {
    case 3: value_pass<E, 3>(runs, k.bs, D, probs + g, outs + g, p.v_scale); break;
    case 2: value_pass<E, 2>(runs, k.bs, D, probs + g, outs + g, p.v_scale); break;
    case 1: value_pass<E, 1>(runs, k.bs, D, probs + g, outs + g, p.v_scale); break;
    default: break;
  }
}

}  // namespace
}  // namespace vllm_lite::cpu

#ifdef VLLM_LITE_BF16_DOT
#include "cpu/attention_bf16dp.h"
#endif
#ifdef VLLM_LITE_BF16_AVX2
#include "cpu/attention_bf16_avx2.h"
#endif

namespace vllm_lite::cpu {
namespace {

void run_task(const AttentionParams& p, int64_t task, float* scratch) {
  if (p.flash_layout) {
    switch (p.cache_dtype) {
      case KvDType::kFp8E4M3: return attention_task<KvDType::kFp8E4M3, true>(p, task, scratch);
      case KvDType::kFp8E5M2: return attention_task<KvDType::kFp8E5M2, true>(p, task, scratch);
      case KvDType::kFloat32: return attention_task<KvDType::kFloat32, true>(p, task, scratch);
      case KvDType::kFloat16: return attention_task<KvDType::kFloat16, true>(p, task, scratch);
      case KvDType::kBFloat16: return attention_task<KvDType::kBFloat16, true>(p, task, scratch);
    }
  }
  switch (p.cache_dtype) {
    case KvDType::kFp8E4M3: return attention_task<KvDType::kFp8E4M3, false>(p, task, scratch);
    case KvDType::kFp8E5M2: return attention_task<KvDType::kFp8E5M2, false>(p, task, scratch);
    case KvDType::kFloat32: return attention_task<KvDType::kFloat32, false>(p, task, scratch);
    case KvDType::kFloat16: return attention_task<KvDType::kFloat16, false>(p, task, scratch);
    case KvDType::kBFloat16:
#if defined(VLLM_LITE_BF16_DOT)
      return attention_task_bf16dp(p, task, scratch);
#elif defined(VLLM_LITE_BF16_AVX2)
      if (bf16_avx2_fits(p)) return attention_task_bf16_avx2(p, task, scratch);
      return attention_task<KvDType::kBFloat16, false>(p, task, scratch);
#else
      return attention_task<KvDType::kBFloat16, false>(p, task, scratch);
#endif
  }
}

}  // namespace

AttentionTaskFn VLLM_LITE_ISA_FN() { return &run_task; }

}  // namespace vllm_lite::cpu
