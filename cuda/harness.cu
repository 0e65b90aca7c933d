// The NCCL-shaped harness that the GPU tests and benchmark drive (not part of the plugin .so): one block
// per channel; thread 0 calls the hook through a function pointer at START and STOP of every work item,
// with the event on its stack, exactly as NCCL's kernel does under the RFC. Work items come in batches of
// nWorks with one funcId; workCounter is per channel, loaded at kernel start and stored back at the end
// (NCCL's semantics: it persists across kernels and advances for every work item).
// Compiled as relocatable code and device-linked on its own, so the hook is a cross-module call.
#include "ncclscope.h"

enum { BY_POINTER = 0, BY_VALUE = 1, INLINE_STORE = 2, BY_POINTER_32 = 3 };

template <int Mode>
__device__ __forceinline__ void harness_event(void* fn, void* ctx, uint64_t wc, uint32_t funcId, uint32_t channel,
                                              uint32_t phase) {
  if (Mode == BY_POINTER) {
    if (fn == nullptr) return;  // baseline: no hook
    ncclProfilerDevEvent_t ev = {ncclscope_globaltimer(), wc, funcId, (uint8_t)channel, (uint8_t)phase, 0};
    ((ncclscopeHookFn)fn)(&ev, ctx);
  } else if (Mode == BY_POINTER_32) {
    // The RFC event with a p2p work's peers appended (32 bytes), for ncclscope_ref_event32.
    struct {
      ncclProfilerDevEvent_t ev;
      int32_t sendRank, recvRank;
    } e = {{ncclscope_globaltimer(), wc, funcId, (uint8_t)channel, (uint8_t)phase, 0}, (int32_t)channel,
           (int32_t)channel + 1};
    ((ncclscopeHookFn)fn)(&e.ev, ctx);
  } else if (Mode == BY_VALUE) {
    ((ncclscopeHookByValFn)fn)(ncclscope_globaltimer(), wc, funcId, channel | phase << 8, ctx);
  } else {
    // NCCL's own inline timing: {timestamp, counter} into a 64-entry per-channel ring, plain stores.
    volatile uint64_t* e = (uint64_t*)ctx + ((channel * 64 + (wc & 63)) * 2 + phase) * 2;
    e[0] = ncclscope_globaltimer();
    e[1] = wc;
  }
}

template <int Mode>
__device__ __forceinline__ void harness(void* fn, void* ctx, uint64_t* workCounters, uint32_t nBatches, uint32_t nWorks,
                                        uint32_t funcId, uint32_t spinNs) {
  const uint32_t channel = blockIdx.x;
  uint64_t wc = threadIdx.x == 0 ? workCounters[channel] : 0;
  uint64_t spun = 0;
  for (uint32_t b = 0; b < nBatches; b++) {
    const uint32_t func = funcId + ((wc / nWorks) & 1);  // one funcId per batch, alternating
    if (threadIdx.x == 0)
      for (uint32_t k = 1; k <= nWorks; k++) harness_event<Mode>(fn, ctx, wc + k, func, channel, 0);
    __syncthreads();
    if (spinNs) {
      // The "work" of the item: a busy loop keeping a dozen 64-bit values live, so that the kernel, like
      // NCCL's (96 registers on sm_90), allocates more registers than the hook may use.
      uint64_t acc[12];
#pragma unroll
      for (int j = 0; j < 12; j++) acc[j] = threadIdx.x + j;
      const uint64_t t0 = ncclscope_globaltimer();
      for (uint64_t t = t0; t - t0 < spinNs; t = ncclscope_globaltimer()) {
#pragma unroll
        for (int j = 0; j < 12; j++) acc[j] = acc[j] * 0x9e3779b97f4a7c15ull + (t >> j);
      }
#pragma unroll
      for (int j = 0; j < 12; j++) spun ^= acc[j];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (uint32_t k = 1; k <= nWorks; k++) harness_event<Mode>(fn, ctx, wc + k, func, channel, 1);
      wc += nWorks;
    }
  }
  if (threadIdx.x == 0) workCounters[channel] = wc + (spun == 0x7fffffffffffffffull);  // keeps the work observable
}

extern "C" __global__ void ncclscope_harness(void* hook, void* devCtx, uint64_t* workCounters, uint32_t nBatches,
                                             uint32_t nWorks, uint32_t funcId, uint32_t spinNs) {
  harness<BY_POINTER>(hook, devCtx, workCounters, nBatches, nWorks, funcId, spinNs);
}
extern "C" __global__ void ncclscope_harness_byval(void* hook, void* devCtx, uint64_t* workCounters, uint32_t nBatches,
                                                   uint32_t nWorks, uint32_t funcId, uint32_t spinNs) {
  harness<BY_VALUE>(hook, devCtx, workCounters, nBatches, nWorks, funcId, spinNs);
}
extern "C" __global__ void ncclscope_harness_event32(void* hook, void* devCtx, uint64_t* workCounters, uint32_t nBatches,
                                                     uint32_t nWorks, uint32_t funcId, uint32_t spinNs) {
  harness<BY_POINTER_32>(hook, devCtx, workCounters, nBatches, nWorks, funcId, spinNs);
}
extern "C" __global__ void ncclscope_harness_inline(void* unused, void* ring, uint64_t* workCounters, uint32_t nBatches,
                                                    uint32_t nWorks, uint32_t funcId, uint32_t spinNs) {
  harness<INLINE_STORE>(unused, ring, workCounters, nBatches, nWorks, funcId, spinNs);
}
