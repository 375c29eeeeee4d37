// at::vec picks its implementation from CPU_CAPABILITY_* macros, which PyTorch defines only for
// its own per-ISA builds. Select the one this translation unit is compiled for (AVX-512 under
// -march=native where the CPU has it, else AVX2+FMA); without them at::vec falls back to scalar
// loops. Include this before any ATen header.
#pragma once

#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#endif
