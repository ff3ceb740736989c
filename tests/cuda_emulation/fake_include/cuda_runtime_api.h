// Stand-in for the CUDA header of the same name in the CPU emulation build.
#pragma once
#include "../cuda_shim.h"
