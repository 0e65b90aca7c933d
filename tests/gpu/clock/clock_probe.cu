// Ground truth for the GPU clock (%globaltimer) against CLOCK_REALTIME, for tests/gpu/clock/run.sh.
// Built there as a shared library (nvcc -arch=sm_90 -shared) that clock_probe.py calls through ctypes,
// so that the flag exchange, ncclscope's plugin (through PyTorch's NCCL) and CUPTI (through PyTorch's
// profiler) all measure the same clocks in one process.
//
// The flag exchange: the host reads CLOCK_REALTIME (h0), writes ping i into host-mapped memory; the
// kernel, spinning on it, reads %globaltimer (g) and writes it back; the host sees the answer and
// reads CLOCK_REALTIME again (h1). The kernel's read happened between h0 and h1, so
//   h0 - g <= (realtime - globaltimer) <= h1 - g
// holds for every sample without any symmetry assumption; over a batch (a millisecond) the bound is
// [max(h0 - g), min(h1 - g)].
#include <cstdint>
#include <ctime>
#include <cuda_runtime.h>

// The plugin's own calibration kernel and clock read (no ring layout needed): the exchange below is
// the one the plugin's calibrations make, bounded both ways against CLOCK_REALTIME.
#include "../../../cuda/calibrate.cuh"

static uint64_t realtime_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// One thread: %globaltimer at its first instruction and at its last, `spin_ns` apart (CUPTI's kernel
// record of the same launch is compared with them).
__global__ void stamp(uint64_t* out, uint64_t spin_ns) {
  const uint64_t t0 = ncclscope_globaltimer();
  uint64_t t = t0;
  while (t - t0 < spin_ns) t = ncclscope_globaltimer();
  out[0] = t0;
  out[1] = ncclscope_globaltimer();
}

static const uint32_t MAX_N = 4096;
static volatile uint64_t* host_words = nullptr;  // go, then out[0..MAX_N]
static uint64_t* dev_words = nullptr;
static uint64_t* stamps = nullptr;  // device memory, 2 words per stamp launch

extern "C" int probe_init() {
  if (host_words) return 0;
  void* p = nullptr;
  if (cudaHostAlloc(&p, (MAX_N + 2) * 8, cudaHostAllocMapped) != cudaSuccess) return 1;
  host_words = (volatile uint64_t*)p;
  if (cudaHostGetDevicePointer((void**)&dev_words, p, 0) != cudaSuccess) return 2;
  if (cudaMalloc((void**)&stamps, 2 * 8 * MAX_N) != cudaSuccess) return 3;
  return 0;
}

// n samples of the flag exchange: h0[i], g[i], h1[i]; *tick the globaltimer step. 0 on success.
extern "C" int probe_exchange(uint32_t n, uint64_t* h0, uint64_t* g, uint64_t* h1, uint64_t* tick) {
  if (probe_init() != 0 || n > MAX_N) return 10;
  for (uint32_t i = 0; i < n + 2; i++) host_words[i] = 0;
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return 11;
  ncclscope_calibrate<<<1, 1, 0, s>>>(dev_words, dev_words + 1, n);
  if (cudaGetLastError() != cudaSuccess) return 12;
  volatile uint64_t* out = host_words + 1;
  const uint64_t start = realtime_ns();
  while (out[0] == 0) {
    if (realtime_ns() - start > 2000000000ull) return 13;
  }
  *tick = out[0];
  int rc = 0;
  for (uint32_t i = 1; i <= n; i++) {
    const uint64_t a = realtime_ns();
    __atomic_store_n(&host_words[0], (uint64_t)i, __ATOMIC_RELEASE);
    uint64_t v;
    while ((v = __atomic_load_n(&out[i], __ATOMIC_ACQUIRE)) == 0) {
      if (realtime_ns() - a > 100000000ull) { rc = 14; break; }
    }
    if (rc) break;
    h1[i - 1] = realtime_ns();
    h0[i - 1] = a;
    g[i - 1] = v;
  }
  host_words[0] = ~0ull;  // ends the kernel whatever it waits for
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  return rc;
}

// `count` stamp kernels on `stream` (PyTorch's current stream, as an integer), each spinning
// `spin_ns`; copies the 2 * count globaltimer values to `out` (synchronises).
extern "C" int probe_stamps(uint64_t stream, uint32_t count, uint64_t spin_ns, uint64_t* out) {
  if (probe_init() != 0 || count > MAX_N) return 20;
  cudaStream_t s = (cudaStream_t)stream;
  for (uint32_t i = 0; i < count; i++) stamp<<<1, 1, 0, s>>>(stamps + 2 * i, spin_ns);
  if (cudaGetLastError() != cudaSuccess) return 21;
  if (cudaMemcpyAsync(out, stamps, 2 * 8 * count, cudaMemcpyDeviceToHost, s) != cudaSuccess) return 22;
  return cudaStreamSynchronize(s) == cudaSuccess ? 0 : 23;
}
