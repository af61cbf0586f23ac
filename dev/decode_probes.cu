// decode_probes.cu: the probe kernels of dev/decode_probes.py (not part of the engine).
// probe_link and probe_persist are shaped like the decode GEMVs: 288 threads, two CTAs an SM
// (the launch's dynamic shared memory decides), x of k halves staged into shared memory with
// 16-byte cp.async. probe_stream is a bare ring of bulk copies.
#include "common.cuh"

constexpr int kProbeThreads = 288;
constexpr int kProbeWarps = kProbeThreads / kWarp;

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// x (k halves) -> shared memory xs; every thread returns once all of x has landed.
__device__ __forceinline__ void stage_x(const half* xin, int k, uint4* xs) {
  const uint4* x4 = reinterpret_cast<const uint4*>(xin);
  for (int v = threadIdx.x; v < k / 8; v += blockDim.x) cp_async16(xs + v, x4 + v);
  cp_async_wait_all();
  __syncthreads();
}

// This CTA's slice of xout (k halves) from a sum over the staged x: the next round reads every
// CTA's slice, so it depends on the whole grid.
__device__ __forceinline__ void write_slice(const uint4* xs, half* xout, int k, float* red) {
  const int tid = threadIdx.x;
  float s = 0.f;
  for (int v = tid; v < k / 8; v += blockDim.x)
    s += __half2float(__ushort_as_half((unsigned short)(xs[v].x & 0xffffu)));
  s = block_sum<kProbeWarps>(s, red);
  const int per = (k + gridDim.x - 1) / gridDim.x, i = blockIdx.x * per + tid;
  if (tid < per && i < k) xout[i] = __float2half(s * 1e-4f);
}

// One link of a chain of launches. Before the (optional) griddepcontrol.wait, CTAs with
// blockIdx.x % w_every == 0 request w_bytes of w (their own bytes; the host passes memory no
// other link reads) with bulk copies into shared memory after x's room. lat_ns[blockIdx.x]:
// nanoseconds from the wait to x landed (thread 0's view).
extern "C" __global__ void __launch_bounds__(kProbeThreads, 2)
probe_link(const half* xin, half* xout, int k, int wait, const unsigned char* w,
           unsigned w_bytes, int w_every, unsigned* lat_ns) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float red[kProbeWarps];
  __shared__ __align__(8) unsigned long long wbar;
  const bool weights = w_bytes > 0 && blockIdx.x % w_every == 0;
  if (threadIdx.x == 0) {
    mbar_init(smem_addr(&wbar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  pdl_trigger();
  if (weights && threadIdx.x == 0) {
    const uint32_t bar = smem_addr(&wbar), dst = smem_addr(smem + k * 2);
    const unsigned char* src = w + (size_t)(blockIdx.x / w_every) * w_bytes;
    mbar_arrive_expect_tx(bar, w_bytes);
    for (unsigned o = 0; o < w_bytes; o += 16384)
      bulk_g2s(dst + o, src + o, min(16384u, w_bytes - o), bar);
  }
  if (wait) pdl_wait();
  const unsigned long long t0 = globaltimer();
  uint4* xs = reinterpret_cast<uint4*>(smem);
  stage_x(xin, k, xs);
  if (threadIdx.x == 0) lat_ns[blockIdx.x] = (unsigned)(globaltimer() - t0);
  write_slice(xs, xout, k, red);
  if (weights) mbar_wait(smem_addr(&wbar), 0);  // no CTA leaves with its copies in flight
}

// The same rounds inside one launch, a grid barrier between them: one counter, each CTA's
// thread 0 arrives (release) and spins (acquire) until the whole grid has arrived. Every CTA
// must be resident (the host launches two an SM). The counter only grows, by gridDim.x a
// round: zero it before the first launch and keep the grid size.
extern "C" __global__ void __launch_bounds__(kProbeThreads, 2)
probe_persist(half* xa, half* xb, int k, int rounds, unsigned* bar) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float red[kProbeWarps];
  uint4* xs = reinterpret_cast<uint4*>(smem);
  for (int r = 0; r < rounds; ++r) {
    stage_x(r & 1 ? xb : xa, k, xs);
    write_slice(xs, r & 1 ? xa : xb, k, red);
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned old, now;
      asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(bar)
                   : "memory");
      const unsigned target = (old / gridDim.x + 1) * gridDim.x;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar) : "memory");
      } while ((int)(now - target) < 0);
    }
    __syncthreads();
  }
}

// A ring of bulk copies and nothing else: np producer warps (lane 0 of warps 0..np-1) take
// slots i = p, p + np, ..., each `cpi` copies of `copy` bytes (this CTA's contiguous range)
// landing on the slot's full mbarrier; lane 0 of warp np releases every slot as it lands.
constexpr int kProbeMaxSlots = 64;
extern "C" __global__ void __launch_bounds__(kProbeThreads, 1)
probe_stream(const unsigned char* src, long long per_cta, unsigned copy, int cpi, int slots,
             int np) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) unsigned long long full[kProbeMaxSlots], empty[kProbeMaxSlots];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const unsigned chunk = copy * cpi;
  const long long n = per_cta / chunk;
  const unsigned char* base = src + (size_t)blockIdx.x * per_cta;
  if (warp < np && lane == 0) {
    for (long long i = warp; i < n; i += np) {
      const int slot = (int)(i % slots);
      const unsigned round = (unsigned)(i / slots), bar = smem_addr(&full[slot]);
      if (round > 0) mbar_wait(smem_addr(&empty[slot]), (round - 1) & 1);
      mbar_arrive_expect_tx(bar, chunk);
      for (int c = 0; c < cpi; ++c)
        bulk_g2s(smem_addr(ring + (size_t)slot * chunk + c * copy), base + i * chunk + c * copy,
                 copy, bar);
    }
  } else if (warp == np && lane == 0) {
    for (long long i = 0; i < n; ++i) {
      const int slot = (int)(i % slots);
      mbar_wait(smem_addr(&full[slot]), (unsigned)(i / slots) & 1);
      mbar_arrive(smem_addr(&empty[slot]));
    }
  }
}
