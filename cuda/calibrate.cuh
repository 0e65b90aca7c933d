// The GPU clock calibration kernel, apart from the ring layout so that the GPU clock probe
// (tests/gpu/clock/clock_probe.cu, built without plugin/build.rs) runs the plugin's own exchange.
#pragma once
#include "clock.cuh"

// Clock calibration, one thread. Reports the globaltimer tick in out[0] (which also says "started"),
// then for i = 1..n waits until the host writes i to *go and answers with the clock in out[i]. The host
// brackets each answer with CLOCK_REALTIME reads. Any value the host writes that is not the next ping
// (or a one-second silence) ends the kernel.
extern "C" __global__ void ncclscope_calibrate(volatile uint64_t* go, volatile uint64_t* out, uint32_t n) {
  uint64_t prev = ncclscope_globaltimer(), tick = ~0ull;
  for (int changes = 0; changes < 16;) {
    const uint64_t t = ncclscope_globaltimer();
    if (t != prev) {
      tick = min(tick, t - prev);
      prev = t;
      changes++;
    }
  }
  out[0] = tick;
  for (uint32_t i = 1; i <= n; i++) {
    const uint64_t t0 = ncclscope_globaltimer();
    uint64_t g;
    while ((g = *go) < i) {
      if (ncclscope_globaltimer() - t0 > 1000000000ull) return;
    }
    if (g != i) return;
    out[i] = ncclscope_globaltimer();
  }
}
