// What a KV cache holds, shared by the validation (validate.h) and the CUDA launchers, which
// include no torch header (csrc/cuda/launch_types.h).
#pragma once

namespace vllm_lite {

// What the caches hold (the ops' kv_cache_dtype string): "auto" = the model dtype (the
// query's / key's), else fp8 bytes in a uint8 tensor, as in vLLM: "fp8" = "fp8_e4m3"
// (OCP e4m3fn) or "fp8_e5m2"; they store key / k_scale and value / v_scale, rounded to
// nearest even exactly as torch's float8_e4m3fn / float8_e5m2 casts.
enum class KvCacheDType { kAuto, kFp8E4M3, kFp8E5M2 };

}  // namespace vllm_lite
