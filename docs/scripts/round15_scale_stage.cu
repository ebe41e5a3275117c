// Compile: nvcc -arch=sm_90a -cubin -O3 -o stage.cubin round15_scale_stage.cu && nvdisasm -c stage.cubin
// (the loop between the LDS.128 and the branch is one stage; the LOP3 0x96 XORs are the harness).
// Round 15 prototype: one 64-input stage of one consumer thread (32 weights, 8 scales), the proposed scale path.
#include <cuda_bf16.h>
#include <stdint.h>
__device__ __forceinline__ void e2m1_word(uint32_t q, uint32_t &a, uint32_t &b, uint32_t &c, uint32_t &d) {
  asm("{\n .reg .b32 r, t;\n and.b32 %0, %4, 0x81C081C0;\n shf.r.wrap.b32 r, %4, %4, 4;\n and.b32 %1, r, 0x81C081C0;\n"
      " shf.r.wrap.b32 r, %4, %4, 10;\n and.b32 %2, r, 0x81C081C0;\n shf.r.wrap.b32 r, %4, %4, 30;\n"
      " shf.r.wrap.b32 t, %4, %4, 6;\n and.b32 r, r, 0x80C080C0;\n and.b32 t, t, 0x01000100;\n or.b32 %3, r, t;\n}"
      : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(q));
}
// 2 scales (bytes 0,1 of h) -> bf16x2 of s * 2^112: e4m3x2 -> f16x2 (exact), then each half's bits >> 3, | 0x7000
__device__ __forceinline__ uint32_t scale_pair(uint16_t h) {
  uint32_t f, r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(f) : "h"(h));
  asm("lop3.b32 %0, %1, 0x0FFF0FFF, 0x70007000, 0xf8;" : "=r"(r) : "r"(f >> 3));  // (a & b) | c
  return r;
}
__device__ __forceinline__ uint32_t mul_lo(uint32_t w, uint32_t s) {  // w * broadcast(low half of s)
  uint32_t r; asm("{\n .reg .b16 l, h;\n .reg .b32 b;\n mov.b32 {l, h}, %2;\n mov.b32 b, {l, l};\n mul.rn.bf16x2 %0, %1, b;\n}" : "=r"(r) : "r"(w), "r"(s)); return r;
}
__device__ __forceinline__ uint32_t mul_hi(uint32_t w, uint32_t s) {
  uint32_t r; asm("{\n .reg .b16 l, h;\n .reg .b32 b;\n mov.b32 {l, h}, %2;\n mov.b32 b, {h, h};\n mul.rn.bf16x2 %0, %1, b;\n}" : "=r"(r) : "r"(w), "r"(s)); return r;
}
extern "C" __global__ void stage(const uint4 *wq, const uint2 *sq, uint4 *out, int n) {
  __shared__ uint4 ws[128];
  __shared__ uint2 ss[128];
  ws[threadIdx.x] = wq[threadIdx.x]; ss[threadIdx.x] = sq[threadIdx.x];
  __syncthreads();
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int it = 0; it < n; ++it) {
    asm volatile("// STAGE BEGIN");
    uint4 q = ws[(threadIdx.x + it) & 127];   // LDS.128: 32 weights (4 k16 steps x 8)
    uint2 s = ss[(threadIdx.x ^ it) & 127];   // LDS.64: 8 scales, (row r, row r+8) per k16 step
    uint32_t qq[4] = {q.x, q.y, q.z, q.w}, sw[2] = {s.x, s.y};
#pragma unroll
    for (int j = 0; j < 4; ++j) {            // k16 step j: one word -> 4 A registers
      uint32_t a, b, c, d; e2m1_word(qq[j], a, b, c, d);
      uint32_t sp = scale_pair((uint16_t)(j & 1 ? sw[j >> 1] >> 16 : sw[j >> 1]));
      acc.x ^= mul_lo(a, sp); acc.y ^= mul_hi(b, sp); acc.z ^= mul_lo(c, sp); acc.w ^= mul_hi(d, sp);
    }
    asm volatile("// STAGE END");
  }
  out[threadIdx.x] = acc;
}
