// Throughput of vpdpbusd on zmm (AVX-512 VNNI): ten independent accumulator chains, so the latency is hidden and
// the rate is the ports'. The floor of the integer attention kernel (docs/decode-profile.md) is counted in these.
//   cc -O2 -march=native study/vpdpbusd_probe.c -o /tmp/vpdpbusd_probe && taskset -c 1 /tmp/vpdpbusd_probe
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define DP(x) x = _mm512_dpbusd_epi32(x, b, c)

int main(void) {
    __m512i b = _mm512_set1_epi32(0x01020304), c = _mm512_set1_epi32(0x05060708);
    __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2);
    __m512i a3 = _mm512_set1_epi32(3), a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5);
    __m512i a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7), a8 = _mm512_set1_epi32(8);
    __m512i a9 = _mm512_set1_epi32(9);
    const long n = 200000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; ++i) {
        DP(a0); DP(a1); DP(a2); DP(a3); DP(a4); DP(a5); DP(a6); DP(a7); DP(a8); DP(a9);
        __asm__ volatile("" : "+v"(b), "+v"(c)); // the operands stay opaque: no hoisting, no folding
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
        _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)), _mm512_add_epi32(a8, a9)));
    const double ns = (double) (t1.tv_sec - t0.tv_sec)*1e9 + (double) (t1.tv_nsec - t0.tv_nsec);
    printf("{\"ns_per_vpdpbusd_zmm\": %.3f, \"sink\": %d}\n", ns/((double) n*10.0), _mm512_reduce_add_epi32(s));
    return 0;
}
