// The GPU clock every ncclscope timestamp is taken on (ns; its tick is 32 ns on an H100).
#pragma once
#include <stdint.h>

__device__ __forceinline__ uint64_t ncclscope_globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
