// fp16 <-> fp32 conversions for the stand-alone test kernels (ott-kernels-*.c), one pair per ISA.
// All round to nearest, ties to even, like ggml's and numpy's, so stored scales and mins match bit for bit.
#pragma once

#include <stdint.h>
#include <string.h>

static inline uint16_t ott_fp32_to_fp16_scalar(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof(x));
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax   = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) { // inf, nan (kept quiet)
        return (uint16_t) (sign | 0x7c00u | (ax > 0x7f800000u ? 0x0200u : 0u));
    }
    if (ax >= 0x477ff000u) { // >= 65520 rounds to inf
        return (uint16_t) (sign | 0x7c00u);
    }
    const uint32_t e = ax >> 23;
    if (e < 113) { // below 2^-14: fp16 subnormal (unit 2^-24) or zero
        if (e < 102) {
            return (uint16_t) sign;
        }
        const uint32_t m     = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e; // 14..24
        uint32_t h = m >> shift;
        const uint32_t rem  = m & ((1u << shift) - 1);
        const uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1u))) {
            h++;
        }
        return (uint16_t) (sign | h);
    }
    uint32_t h = ((e - 112) << 10) | ((ax & 0x7fffffu) >> 13);
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) {
        h++; // a carry into the exponent is the correctly rounded result
    }
    return (uint16_t) (sign | h);
}

static inline float ott_fp16_to_fp32_scalar(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    const uint32_t e    = (h >> 10) & 0x1fu;
    const uint32_t m    = h & 0x3ffu;
    uint32_t x;
    if (e == 0) {
        const float v = (float) m * 0x1p-24f; // exact
        memcpy(&x, &v, sizeof(x));
        x |= sign;
    } else if (e == 31) {
        x = sign | 0x7f800000u | (m << 13);
    } else {
        x = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &x, sizeof(f));
    return f;
}

#if defined(__F16C__)
#include <immintrin.h>
static inline uint16_t ott_fp32_to_fp16_f16c(float f) { return (uint16_t) _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
static inline float    ott_fp16_to_fp32_f16c(uint16_t h) { return _cvtsh_ss(h); }
#define ott_fp32_to_fp16_avx2   ott_fp32_to_fp16_f16c
#define ott_fp16_to_fp32_avx2   ott_fp16_to_fp32_f16c
#define ott_fp32_to_fp16_avx512 ott_fp32_to_fp16_f16c
#define ott_fp16_to_fp32_avx512 ott_fp16_to_fp32_f16c
#define ott_fp32_to_fp16_avx512vnni ott_fp32_to_fp16_f16c
#define ott_fp16_to_fp32_avx512vnni ott_fp16_to_fp32_f16c
#endif

#if defined(__aarch64__)
static inline uint16_t ott_fp32_to_fp16_neon(float f) {
    const __fp16 h = (__fp16) f;
    uint16_t u;
    memcpy(&u, &h, sizeof(u));
    return u;
}
static inline float ott_fp16_to_fp32_neon(uint16_t u) {
    __fp16 h;
    memcpy(&h, &u, sizeof(h));
    return (float) h;
}
#endif
