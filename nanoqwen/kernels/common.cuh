// common.cuh: helpers shared by the decode and prefill kernels (sm_90a, fp16 activations, fp32
// math): PDL, reductions, cp.async, ldmatrix, mma.sync, fp16x2 arithmetic, INT4 dequantization.
//
// The model dims (kHidden, kHeadDim, ...) and the kernels' geometry arrive as constexpr from the
// generated header (nanoqwen/cuda/registry.py header()), which nanoqwen.cuda.jit prepends to
// every source; nothing here hard-codes a model.
#pragma once
#include <cuda_fp16.h>
typedef unsigned int uint32_t;  // NVRTC has no libc headers (stdint.h)

constexpr int kWarp = 32;
constexpr float kLog2e = 1.4426950408889634f;
// -inf without math.h (NVRTC): the empty-set value of a running max.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
// 2^x; ex2.approx(-inf) = +0, which the attention kernels' masking and empty states rely on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch (PDL). `pdl_wait` blocks until the previous kernel in the stream
// has finished (or triggered) and its writes are visible; `pdl_trigger` lets the next kernel
// start its prologue early. Both are no-ops when the launch did not enable PDL.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;" :::);
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// 16-byte global -> shared copy that bypasses the registers (LDGSTS); cp_async_wait_all() makes
// this thread's copies complete (a __syncthreads() then publishes them to the CTA).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}
// The commit-group form: `src_bytes` < 16 zero-fills the rest of the destination (rows past the
// end read 0 bytes from a valid address); cp_async_wait<N>() leaves at most N groups pending.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// mbarriers (shared::cta) and Hopper's 1-D bulk async copy (the producer/consumer rings).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Blocks until the phase with the given parity has completed (try_wait may time out: loop).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// Whether the phase with the given parity has completed (no blocking).
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done;
}
// *p += v at gpu scope with acquire-release semantics; returns the old value.
__device__ __forceinline__ int atom_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v)
               : "memory");
  return old;
}
// Orders this thread's generic-proxy accesses to shared memory (loads, st.shared, cp.async
// writes) before later async-proxy ones (bulk copies, wgmma operand reads) of the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// 1-D bulk copy global -> shared, completing `bytes` of transactions on mbarrier `bar`.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// A CUtensorMap, passed by value as a __grid_constant__ kernel parameter.
struct alignas(64) TensorMap {
  unsigned long long words[16];
};
// The box at (c0 along the inner dimension, c1 along the outer) of `map` into shared memory at
// `dst`, completing its bytes on mbarrier `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap& map, int c0, int c1,
                                            unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The 3-D box at (c0 innermost, c1, c2 outermost) of `map` into shared memory at `dst`
// (128-byte aligned), completing its bytes (the whole box, zero-filled parts included) on `bar`.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TensorMap& map, int c0, int c1,
                                            int c2, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2),
        "r"(bar)
      : "memory");
}

// bar.sync on named barrier `id` (1..15; 0 is __syncthreads') by `threads` threads.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ldmatrix from a shared-memory address (smem_addr) or a generic pointer into shared memory.
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* p) {
  ldmatrix_x4(r, smem_addr(p));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* p) {
  ldmatrix_x4_trans(r, smem_addr(p));
}

// D (fp32 16x8) += A (fp16 16x16, row) * B (fp16 16x8, col).
__device__ __forceinline__ void mma_16816(float c[4], const unsigned a[4], unsigned b0,
                                          unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// fp16x2 in 32-bit registers (the prefill kernels keep halves as raw bits: half_t).
typedef unsigned short half_t;
__device__ __forceinline__ unsigned hsub2(unsigned a, unsigned b) {
  unsigned d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ unsigned hmul2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ unsigned hfma2(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ float half_to_float(half_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  unsigned d;  // cvt.rn.f16x2.f32 d, a, b puts a in the upper half
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// The greedy sampler's key of logit v at vocabulary id `id` (lm_head_argmax and lm_head_rows
// take its atomicMax, sample_finish decodes it): the float ordered as an unsigned int above the
// complemented id, so ties go to the lowest id (sampling.py's greedy rule).
__device__ __forceinline__ unsigned long long argmax_key(float v, int id) {
  uint32_t b = __float_as_uint(v);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return ((unsigned long long)b << 32) | (0xFFFFFFFFu - (uint32_t)id);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of `NWARPS` warps; every thread gets the result. `scratch`: NWARPS floats.
template <int NWARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) total += scratch[w];
  __syncthreads();  // scratch may be reused right after
  return total;
}

// RMSNorm of a vector held as uint4 (8 halves each): the squares of one vector added to ss,
// then (the kernel reducing the partial sums its own way) rmsnorm_vec per vector.
__device__ __forceinline__ void add_squares(float& ss, uint4 xv) {
  const half2* h = reinterpret_cast<const half2*>(&xv);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(h[j]);
    ss += f.x * f.x + f.y * f.y;
  }
}
// The partial sum of squares of thread `tid` of `nthreads` over vectors tid, tid + nthreads, ...
// of a vector staged in shared memory.
__device__ __forceinline__ float sum_squares(const uint4* xs, int nvec, int tid, int nthreads) {
  float ss = 0.f;
  for (int v = tid; v < nvec; v += nthreads) add_squares(ss, xs[v]);
  return ss;
}
// fp16(x * rstd * w) of one 16-byte vector (one rounding, as the reference).
__device__ __forceinline__ uint4 rmsnorm_vec(uint4 xv, uint4 wn, float rstd) {
  half2* h = reinterpret_cast<half2*>(&xv);
  const half2* gw = reinterpret_cast<const half2*>(&wn);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(h[j]), gf = __half22float2(gw[j]);
    h[j] = __floats2half2_rn(f.x * rstd * gf.x, f.y * rstd * gf.y);
  }
  return xv;
}

// ValueShuffle word -> four half2 pairs (v0,v1) (v2,v3) (v4,v5) (v6,v7), exact signed values.
// Pair i sits in bits (w >> 4i) & 0x000F000F (one nibble per 16-bit half). XOR with 0x0008
// turns the two's-complement nibble v into u = v + 8 (0..15); OR-ing exponent 0x6400 makes the
// half 1024 + u exactly; subtracting 1032 leaves v. Pairs 1 and 3 are taken in place (mask
// 0x00F0 and XOR 0x0080: the half 1024 + 16u) and brought back with one fma (x / 16 - 72), so
// one shift serves all four pairs. `lop3` does each mask and XOR in one instruction.
__device__ __forceinline__ void dequant_word(uint32_t w, half2 (&out)[4]) {
  const half2 bias = __half2half2(__ushort_as_half(0x6408));   // 1032
  const half2 inv16 = __half2half2(__ushort_as_half(0x2C00));  // 1/16
  const half2 bias16 = __half2half2(__ushort_as_half(0xD480)); // -72
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t x = i ? w >> 8 : w;
    uint32_t lo, hi;  // 0x6a = (a & b) ^ c
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(lo) : "r"(x), "r"(0x000F000Fu), "r"(0x64086408u));
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(hi) : "r"(x), "r"(0x00F000F0u), "r"(0x64806480u));
    out[2 * i] = __hsub2(*reinterpret_cast<half2*>(&lo), bias);
    out[2 * i + 1] = __hfma2(*reinterpret_cast<half2*>(&hi), inv16, bias16);
  }
}
