// emu_kernels: runs test cases of the CUDA ops on the SIMT emulator.
//
//   emu_kernels SEEDS CASE_DIR...
//
// SEEDS: comma-separated schedule seeds (0 = in-order); each case runs once per seed, from
// freshly loaded inputs. A case directory holds spec.txt and its buffers as raw files.
// spec.txt lines:
//   op NAME                       attention | varlen | reshape_and_cache | copy_blocks
//                                 | swap_blocks | convert | selftest | rms_norm
//                                 | fused_add_rms_norm | silu_and_mul | rotary_embedding
//                                 | decode_path | varlen_path | fused_moe
//   dtype f32|f16|bf16
//   kv auto|fp8_e4m3|fp8_e5m2     what the caches hold (default auto: the dtype)
//   KEY INT_OR_FLOAT              the op's scalar arguments (see run_case)
//   buf NAME FILE OFFSET          NAME's bytes come from FILE, placed OFFSET bytes into an
//                                 allocation of exactly OFFSET + size bytes (ASan sees
//                                 any access past the end)
//   out NAME                      written back to CASE_DIR/NAME.s<SEED>.bin after each run
// attention, varlen: cc (compute capability the launcher plans for, default 75: the SIMT
// kernels everywhere); an optional buffer "path" (int32) receives the kernel path it chose.
// Prints "CASE_START dir" / "CASE_DONE dir" so a harness can tell which case a crash
// (sanitizer report, emulator error) belongs to.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/attention/attention_path.h"
#include "cuda/dtype.cuh"  // the fp8 cache element types
#include "emu_ops.h"
#include "emu_runtime.h"

namespace emu_ops {
void run_selftest(const std::string& name, void* in, int64_t in_bytes, void* out);
}

namespace {

struct Buffer {
  std::string file;
  size_t offset = 0;
  size_t size = 0;
  char* base = nullptr;
  char* data() const { return base + offset; }
};

struct Case {
  std::string dir;
  std::map<std::string, std::string> kv;
  std::map<std::string, Buffer> bufs;
  std::vector<std::string> outs;

  int64_t i(const std::string& k) const {
    auto it = kv.find(k);
    if (it == kv.end()) throw std::runtime_error(dir + ": spec lacks " + k);
    return std::stoll(it->second);
  }
  int64_t i(const std::string& k, int64_t dflt) const { return kv.count(k) ? i(k) : dflt; }
  double f(const std::string& k) const {
    auto it = kv.find(k);
    if (it == kv.end()) throw std::runtime_error(dir + ": spec lacks " + k);
    return std::stod(it->second);
  }
  const std::string& s(const std::string& k) const {
    auto it = kv.find(k);
    if (it == kv.end()) throw std::runtime_error(dir + ": spec lacks " + k);
    return it->second;
  }
  void* p(const std::string& name) const {
    auto it = bufs.find(name);
    if (it == bufs.end()) throw std::runtime_error(dir + ": spec lacks buffer " + name);
    return it->second.data();
  }
  void* p_or_null(const std::string& name) const { return bufs.count(name) ? p(name) : nullptr; }
  int64_t bytes(const std::string& name) const {
    auto it = bufs.find(name);
    if (it == bufs.end()) throw std::runtime_error(dir + ": spec lacks buffer " + name);
    return static_cast<int64_t>(it->second.size);
  }
};

Case read_spec(const std::string& dir) {
  Case c;
  c.dir = dir;
  std::ifstream in(dir + "/spec.txt");
  if (!in) throw std::runtime_error("cannot read " + dir + "/spec.txt");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key;
    if (!(ls >> key)) continue;
    if (key == "buf") {
      std::string name;
      Buffer b;
      ls >> name >> b.file >> b.offset;
      c.bufs[name] = b;
    } else if (key == "out") {
      std::string name;
      ls >> name;
      c.outs.push_back(name);
    } else {
      std::string value;
      ls >> value;
      c.kv[key] = value;
    }
  }
  return c;
}

void load_buffers(Case& c) {
  for (auto& [name, b] : c.bufs) {
    std::ifstream f(c.dir + "/" + b.file, std::ios::binary | std::ios::ate);
    if (!f) throw std::runtime_error("cannot read " + c.dir + "/" + b.file);
    b.size = static_cast<size_t>(f.tellg());
    f.seekg(0);
    void* mem = nullptr;
    // malloc'd exactly: ASan's redzone starts right after the last byte.
    if (posix_memalign(&mem, 64, b.offset + b.size + (b.offset + b.size == 0 ? 1 : 0)) != 0) {
      throw std::runtime_error("out of memory");
    }
    b.base = static_cast<char*>(mem);
    memset(b.base, 0, b.offset);
    f.read(b.data(), static_cast<std::streamsize>(b.size));
  }
}

void free_buffers(Case& c) {
  for (auto& [name, b] : c.bufs) {
    free(b.base);
    b.base = nullptr;
  }
}

void write_outputs(const Case& c, uint64_t seed) {
  for (const auto& name : c.outs) {
    const auto& b = c.bufs.at(name);
    std::ofstream f(c.dir + "/" + name + ".s" + std::to_string(seed) + ".bin", std::ios::binary);
    f.write(b.data(), static_cast<std::streamsize>(b.size));
  }
}

emu_ops::DType dtype_of(const Case& c) {
  const std::string& d = c.s("dtype");
  if (d == "f32") return emu_ops::DType::F32;
  if (d == "f16") return emu_ops::DType::F16;
  if (d == "bf16") return emu_ops::DType::BF16;
  throw std::runtime_error("unknown dtype " + d);
}

template <typename F>
void dispatch(emu_ops::DType t, F&& f) {
  switch (t) {
    case emu_ops::DType::F32: f(float{}); break;
    case emu_ops::DType::F16: f(__half{}); break;
    case emu_ops::DType::BF16: f(__nv_bfloat16{}); break;
  }
}

emu_ops::KvKind kv_of(const Case& c) {
  if (!c.kv.count("kv")) return emu_ops::KvKind::Auto;
  const std::string& k = c.s("kv");
  if (k == "auto") return emu_ops::KvKind::Auto;
  if (k == "fp8_e4m3") return emu_ops::KvKind::Fp8E4M3;
  if (k == "fp8_e5m2") return emu_ops::KvKind::Fp8E5M2;
  throw std::runtime_error("unknown kv " + k);
}

// f(T{}, CT{}): the query dtype and the cache element of the case.
template <typename F>
void dispatch_kv(const Case& c, F&& f) {
  dispatch(dtype_of(c), [&](auto tag) {
    using T = decltype(tag);
    switch (kv_of(c)) {
      case emu_ops::KvKind::Auto: f(T{}, T{}); break;
      case emu_ops::KvKind::Fp8E4M3: f(T{}, vllm_lite::cuda::fp8_e4m3{}); break;
      case emu_ops::KvKind::Fp8E5M2: f(T{}, vllm_lite::cuda::fp8_e5m2{}); break;
    }
  });
}

// The arguments paged_attention and varlen_paged_attention share; query points into
// query_storage, q_offset elements in (its view's start), typed by the case's dtype.
void read_attention_args(const Case& c, emu_ops::AttentionArgs& a) {
  a.num_seqs = c.i("num_seqs");
  a.num_heads = c.i("num_heads");
  a.num_kv_heads = c.i("num_kv_heads");
  a.head_size = c.i("head_size");
  a.block_size = c.i("block_size");
  a.num_blocks = c.i("num_blocks");
  a.max_blocks_per_seq = c.i("max_blocks_per_seq");
  a.q_stride_seq = c.i("q_stride_seq");
  a.q_stride_head = c.i("q_stride_head");
  a.scale = c.f("scale");
  a.k_scale = c.f("k_scale");
  a.v_scale = c.f("v_scale");
  a.key_cache = c.p("key_cache");
  a.value_cache = c.p("value_cache");
  a.block_tables = static_cast<const int32_t*>(c.p("block_tables"));
  a.seq_lens = static_cast<const int32_t*>(c.p("seq_lens"));
  a.alibi_slopes = static_cast<const float*>(c.p_or_null("alibi_slopes"));
  a.flash_layout = c.i("flash", 0) != 0;
  dispatch(dtype_of(c), [&](auto tag) {
    using T = decltype(tag);
    a.query = static_cast<const T*>(c.p("query_storage")) + c.i("q_offset");
  });
}

void run_attention(const Case& c) {
  emu_ops::AttentionArgs a{};
  read_attention_args(c, a);
  a.max_seq_len = c.i("max_seq_len");
  a.sms = c.i("sms");
  a.cc = c.i("cc", 75);
  a.path_out = static_cast<int32_t*>(c.p_or_null("path"));
  // versions (optional): 1 = v1 only (no v2 buffers), 2 = v2 only, 3 = both (default).
  const int64_t versions = c.i("versions", 3);
  dispatch_kv(c, [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using CT = decltype(cache_tag);
    if (versions & 1) emu_ops::paged_attention_v1<T, CT>(a, c.p("out_v1"));
    if (versions & 2) {
      emu_ops::paged_attention_v2<T, CT>(a, c.p("out_v2"), static_cast<float*>(c.p("exp_sums")),
                                         static_cast<float*>(c.p("max_logits")), c.p("tmp_out"),
                                         c.i("num_partitions"));
    }
  });
}

// varlen: query rows are tokens (q_stride_seq between them).
void run_varlen(const Case& c) {
  emu_ops::VarlenArgs a{};
  read_attention_args(c, a);
  a.num_tokens = c.i("num_tokens");
  a.max_query_len = c.i("max_query_len");
  a.query_start_loc = static_cast<const int32_t*>(c.p("query_start_loc"));
  a.cc = c.i("cc", 75);
  a.path_out = static_cast<int32_t*>(c.p_or_null("path"));
  dispatch_kv(c, [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using CT = decltype(cache_tag);
    emu_ops::varlen_paged_attention<T, CT>(a, c.p("out"));
  });
}

void run_reshape_and_cache(const Case& c) {
  emu_ops::CacheWriteArgs a{};
  a.num_tokens = c.i("num_tokens");
  a.num_kv_heads = c.i("num_kv_heads");
  a.head_size = c.i("head_size");
  a.block_size = c.i("block_size");
  a.num_blocks = c.i("num_blocks");
  a.key_stride = c.i("key_stride");
  a.value_stride = c.i("value_stride");
  a.k_scale = c.f("k_scale");
  a.v_scale = c.f("v_scale");
  a.key_cache = c.p("key_cache");
  a.value_cache = c.p("value_cache");
  a.slot_mapping = static_cast<const int64_t*>(c.p("slot_mapping"));
  const bool flash = c.i("flash") != 0;
  dispatch_kv(c, [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using CT = decltype(cache_tag);
    a.key = static_cast<const T*>(c.p("key_storage")) + c.i("key_offset");
    a.value = static_cast<const T*>(c.p("value_storage")) + c.i("value_offset");
    emu_ops::reshape_and_cache<T, CT>(a, flash);
  });
}

void run_copy_blocks(const Case& c) {
  const int64_t layers = c.i("layers");
  const int64_t num_blocks = c.i("num_blocks");
  std::vector<void*> k(static_cast<size_t>(layers)), v(static_cast<size_t>(layers));
  std::vector<int64_t> block_bytes(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l) {
    k[static_cast<size_t>(l)] = c.p("key_cache" + std::to_string(l));
    v[static_cast<size_t>(l)] = c.p("value_cache" + std::to_string(l));
    block_bytes[static_cast<size_t>(l)] = c.bytes("key_cache" + std::to_string(l)) / num_blocks;
  }
  emu_ops::copy_blocks(k.data(), v.data(), block_bytes.data(), layers,
                       static_cast<const int64_t*>(c.p("mapping")), c.i("pairs"), num_blocks);
}

// expect_copies (optional): how many copies the launcher must make (runs merged).
void run_swap_blocks(const Case& c) {
  const int64_t block_bytes = c.i("block_bytes");
  const int64_t copies = emu_ops::swap_blocks(
      c.p("src"), c.p("dst"), static_cast<const int64_t*>(c.p("mapping")), c.i("pairs"),
      block_bytes, static_cast<int64_t>(c.bytes("src")) / block_bytes,
      static_cast<int64_t>(c.bytes("dst")) / block_bytes);
  const int64_t want = c.i("expect_copies", -1);
  if (want >= 0 && copies != want) {
    throw std::runtime_error("swap_blocks made " + std::to_string(copies) + " copies, expected " +
                             std::to_string(want));
  }
}

// Every byte of fp8 format CT through the kernels' decoders into from_fp8_<format> (to_float)
// and chunks_fp8_<format> (chunk_to_float on the 16 chunks holding bytes 0..255 in order).
template <typename CT>
void decode_fp8(const Case& c, const std::string& format) {
  auto* scalar = static_cast<float*>(c.p("from_fp8_" + format));
  auto* chunked = static_cast<float*>(c.p("chunks_fp8_" + format));
  uint8_t bytes[256];
  for (int b = 0; b < 256; ++b) {
    bytes[b] = static_cast<uint8_t>(b);
    scalar[b] = vllm_lite::cuda::to_float(CT{bytes[b]});
  }
  for (int k = 0; k < 16; ++k) {
    uint4 chunk;
    memcpy(&chunk, bytes + 16 * k, sizeof(chunk));
    vllm_lite::cuda::chunk_to_float<CT>(chunk, chunked + 16 * k);
  }
}

// float32 -> half / bfloat16 bits (the shim's conversions), every half / bfloat16 bit
// pattern -> float32, and every fp8 byte -> float32 (decode_fp8).
void run_convert(const Case& c) {
  const auto* in = static_cast<const float*>(c.p("floats"));
  const int64_t n = c.bytes("floats") / 4;
  auto* h = static_cast<__half*>(c.p("to_half"));
  auto* b = static_cast<__nv_bfloat16*>(c.p("to_bf16"));
  for (int64_t i = 0; i < n; ++i) {
    h[i] = __float2half_rn(in[i]);
    b[i] = __float2bfloat16_rn(in[i]);
  }
  auto* hf = static_cast<float*>(c.p("from_half"));
  auto* bf = static_cast<float*>(c.p("from_bf16"));
  for (uint32_t u = 0; u < 65536; ++u) {
    hf[u] = __half2float(__half{static_cast<unsigned short>(u)});
    bf[u] = __bfloat162float(__nv_bfloat16{static_cast<unsigned short>(u)});
  }
  decode_fp8<vllm_lite::cuda::fp8_e4m3>(c, "e4m3");
  decode_fp8<vllm_lite::cuda::fp8_e5m2>(c, "e5m2");
}

// rms_norm / fused_add_rms_norm / silu_and_mul: rows, hidden (silu: the output width d),
// row_stride (the input's), epsilon (norms); input points in_offset elements into
// input_storage (a strided view), out / residual / weight are whole buffers.
emu_ops::RowsArgs read_rows_args(const Case& c) {
  emu_ops::RowsArgs a{};
  a.rows = c.i("rows");
  a.hidden = c.i("hidden");
  a.row_stride = c.i("row_stride", a.hidden);
  a.epsilon = c.kv.count("epsilon") ? c.f("epsilon") : 0.0;
  return a;
}

void run_elementwise(const Case& c, const std::string& op) {
  const emu_ops::RowsArgs a = read_rows_args(c);
  dispatch(dtype_of(c), [&](auto tag) {
    using T = decltype(tag);
    if (op == "rms_norm") {
      const T* x = static_cast<const T*>(c.p("input_storage")) + c.i("in_offset", 0);
      emu_ops::rms_norm<T>(a, c.p("out"), x, c.p("weight"));
    } else if (op == "fused_add_rms_norm") {
      emu_ops::fused_add_rms_norm<T>(a, c.p("input"), c.p("residual"), c.p("weight"));
    } else {
      const T* x = static_cast<const T*>(c.p("input_storage")) + c.i("in_offset", 0);
      emu_ops::silu_and_mul<T>(a, c.p("out"), x);
    }
  });
}

// rotary_embedding: query / key point q_offset / k_offset elements into qkv_storage (one
// buffer: q and k are column slices of a fused row); table f32 | same (the dtype's).
void run_rotary(const Case& c) {
  emu_ops::RotaryArgs a{};
  a.num_tokens = c.i("num_tokens");
  a.num_heads = c.i("num_heads");
  a.num_kv_heads = c.i("num_kv_heads");
  a.head_size = c.i("head_size");
  a.rot_dim = c.i("rot_dim");
  a.max_position = c.i("max_position");
  a.q_stride = c.i("q_stride");
  a.k_stride = c.i("k_stride");
  a.is_neox = c.i("is_neox") != 0;
  a.positions = static_cast<const int64_t*>(c.p("positions"));
  a.cos_sin_cache = c.p("cos_sin_cache");
  const bool f32_table = c.s("table") == "f32";
  dispatch(dtype_of(c), [&](auto tag) {
    using T = decltype(tag);
    a.query = static_cast<T*>(c.p("qkv_storage")) + c.i("q_offset");
    a.key = static_cast<T*>(c.p("qkv_storage")) + c.i("k_offset");
    if (f32_table) {
      emu_ops::rotary_embedding<T, float>(a);
    } else {
      emu_ops::rotary_embedding<T, T>(a);
    }
  });
}

// fused_moe: tokens, hidden, experts, inter, top_k, renormalize (0 / 1), logits f32 | same
// (router_logits float32 or the dtype), cc (default 75: the SIMT GEMMs); buffers hidden,
// router_logits, w13, w2, out, optionally path (int32: the MoePath taken).
void run_moe(const Case& c) {
  emu_ops::MoeArgs a{};
  a.cc = c.i("cc", 75);
  a.path_out = static_cast<int32_t*>(c.p_or_null("path"));
  a.tokens = c.i("tokens");
  a.hidden = c.i("hidden");
  a.experts = c.i("experts");
  a.inter = c.i("inter");
  a.top_k = c.i("top_k");
  a.renormalize = c.i("renormalize") != 0;
  a.hidden_states = c.p("hidden");
  a.router_logits = c.p("router_logits");
  a.w13 = c.p("w13");
  a.w2 = c.p("w2");
  a.out = c.p("out");
  const bool f32_logits = c.s("logits") == "f32";
  dispatch(dtype_of(c), [&](auto tag) {
    using T = decltype(tag);
    if (f32_logits) {
      emu_ops::fused_moe<T, float>(a);
    } else {
      emu_ops::fused_moe<T, T>(a);
    }
  });
}

void run_case(const Case& c) {
  const std::string& op = c.s("op");
  if (op == "attention") {
    run_attention(c);
  } else if (op == "varlen") {
    run_varlen(c);
  } else if (op == "reshape_and_cache") {
    run_reshape_and_cache(c);
  } else if (op == "copy_blocks") {
    run_copy_blocks(c);
  } else if (op == "swap_blocks") {
    run_swap_blocks(c);
  } else if (op == "convert") {
    run_convert(c);
  } else if (op == "rms_norm" || op == "fused_add_rms_norm" || op == "silu_and_mul") {
    run_elementwise(c, op);
  } else if (op == "rotary_embedding") {
    run_rotary(c);
  } else if (op == "fused_moe") {
    run_moe(c);
  } else if (op == "decode_path") {
    // rows of 4 int32 (cc, query is 16-bit, group, head_size) -> out[i] =
    // attn::decode_path(...) of row i.
    const auto* in = static_cast<const int32_t*>(c.p("in"));
    auto* out = static_cast<int32_t*>(c.p("out"));
    for (int64_t i = 0; i < c.bytes("in") / 16; ++i) {
      const int32_t* r = in + 4 * i;
      out[i] = static_cast<int32_t>(
          vllm_lite::cuda::attn::decode_path(r[0], r[1] != 0, r[2], r[3]));
    }
  } else if (op == "varlen_path") {
    // rows of 4 int32 (cc, query is 16-bit, cache is the query dtype, head_size) ->
    // out[i] = attn::varlen_path(...) of row i.
    const auto* in = static_cast<const int32_t*>(c.p("in"));
    auto* out = static_cast<int32_t*>(c.p("out"));
    for (int64_t i = 0; i < c.bytes("in") / 16; ++i) {
      const int32_t* r = in + 4 * i;
      out[i] = static_cast<int32_t>(
          vllm_lite::cuda::attn::varlen_path(r[0], r[1] != 0, r[2] != 0, r[3]));
    }
  } else if (op == "selftest") {
    emu_ops::run_selftest(c.s("test"), c.p_or_null("in"), c.bufs.count("in") ? c.bytes("in") : 0,
                          c.p("out"));
  } else {
    throw std::runtime_error("unknown op " + op);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s SEEDS CASE_DIR...\n", argv[0]);
    return 2;
  }
  std::vector<uint64_t> seeds;
  {
    std::stringstream ss(argv[1]);
    std::string tok;
    while (std::getline(ss, tok, ',')) seeds.push_back(std::stoull(tok));
  }
  for (int a = 2; a < argc; ++a) {
    const std::string dir = argv[a];
    printf("CASE_START %s\n", dir.c_str());
    fflush(stdout);
    try {
      Case c = read_spec(dir);
      for (uint64_t seed : seeds) {
        load_buffers(c);
        cuda_emu::set_schedule_seed(seed);
        run_case(c);
        write_outputs(c, seed);
        free_buffers(c);
      }
    } catch (const std::exception& e) {
      // A TORCH_CHECK of a launcher or a bad spec: this case fails, the others run.
      printf("CASE_ERROR %s %s\n", dir.c_str(), e.what());
      fflush(stdout);
      continue;
    }
    printf("CASE_DONE %s\n", dir.c_str());
    fflush(stdout);
  }
  return 0;
}
