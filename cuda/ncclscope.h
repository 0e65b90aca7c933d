// ncclscope device code: the RFC event and the ring layout. The layout constants are NOT defined here:
// plugin/build.rs passes them as -DNCCLSCOPE_<NAME>=<value> from plugin/src/devhook/layout.rs, their one
// source.
#pragma once
#include <stdint.h>

#ifndef NCCLSCOPE_SLOT_BYTES
#error "build through plugin/build.rs: the ring layout comes from plugin/src/devhook/layout.rs"
#endif

// The RFC's event (NVIDIA/nccl PR #2285), passed by pointer to the hook on thread 0 of each channel's block.
typedef struct {
  uint64_t timestamp;    // %globaltimer ns
  uint64_t workCounter;  // per channel, kept across kernels
  uint32_t funcId;
  uint8_t channelId;
  uint8_t phase;         // 0 START, 1 STOP
  uint16_t rsvd;
} ncclProfilerDevEvent_t;

static_assert(sizeof(ncclProfilerDevEvent_t) == NCCLSCOPE_EVENT_BYTES, "RFC event size");
static_assert(NCCLSCOPE_SLOT_BYTES == NCCLSCOPE_SLOT_WORDS * 8 && NCCLSCOPE_SLOT_WORDS == 6, "three 16-byte lines");

// The RFC hook ABI, and the by-value variant it is compared against.
typedef void (*ncclscopeHookFn)(const ncclProfilerDevEvent_t* ev, void* devCtx);
typedef void (*ncclscopeHookByValFn)(uint64_t timestamp, uint64_t workCounter, uint32_t funcId,
                                     uint32_t channelPhase, void* devCtx);

#include "clock.cuh"
