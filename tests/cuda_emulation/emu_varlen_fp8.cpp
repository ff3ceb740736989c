// The varlen attention kernel reading fp8 (e4m3 / e5m2) caches on the emulator, for every
// query dtype: emu_varlen.cpp's launcher, instantiated for those cache elements.
#define EMU_VARLEN_FP8
#include "emu_varlen.cpp"
