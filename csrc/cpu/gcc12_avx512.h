// Included before <immintrin.h> by every translation unit that uses AVX-512 intrinsics.
// GCC 12's avx512fintrin.h defines _mm512_undefined_*() as a self-initialised variable, so
// every intrinsic that starts from one (_mm512_permute_ps, _mm512_broadcast_i32x4, ...)
// warns "may be used uninitialized" where it is inlined: dozens of false warnings per
// build that would hide a real one (GCC bug 105593, fixed in GCC 13). The warning stays on
// for GCC 13+ and clang. It must precede the intrinsics headers: the warnings' locations
// are theirs.
#pragma once
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
