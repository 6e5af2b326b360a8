// Streaming-read bandwidth of this machine: the floor the decode attention is measured against
// (docs/decode-profile.md). Each of T threads reads its slice of a buffer of S bytes, P passes, two ways:
//   f16: fp16 -> fp32 conversion and a sum (what a dense f16 K/V read costs at least)
//   u8:  a plain byte read summed with psadbw (what reading packed codes costs at least)
// Prints one JSON line per (mode, threads, bytes): the median GB/s over the passes.
// Build: cc -O2 -mavx2 -mf16c -pthread study/bandwidth_probe.c -o bandwidth_probe
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    const uint8_t * p;
    size_t n;
    int mode;
    pthread_barrier_t * bar;
    int passes;
    double * secs; // per pass, written by thread 0
    float sink;
} job;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9*ts.tv_nsec;
}

static float read_f16(const uint8_t * p, size_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 64 <= n; i += 64) {
        a0 = _mm256_add_ps(a0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + i))));
        a1 = _mm256_add_ps(a1, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + i + 16))));
        a2 = _mm256_add_ps(a2, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + i + 32))));
        a3 = _mm256_add_ps(a3, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + i + 48))));
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    return t[0] + t[7];
}

static float read_u8(const uint8_t * p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    const __m256i z = _mm256_setzero_si256();
    for (size_t i = 0; i + 64 <= n; i += 64) {
        a0 = _mm256_add_epi64(a0, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *) (p + i)), z));
        a1 = _mm256_add_epi64(a1, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *) (p + i + 32)), z));
    }
    int64_t t[4];
    _mm256_storeu_si256((__m256i *) t, _mm256_add_epi64(a0, a1));
    return (float) (t[0] + t[3]);
}

static void * run(void * arg) {
    job * j = (job *) arg;
    for (int k = 0; k < j->passes; ++k) {
        pthread_barrier_wait(j->bar);
        const double t0 = now();
        j->sink += j->mode ? read_u8(j->p, j->n) : read_f16(j->p, j->n);
        pthread_barrier_wait(j->bar);
        if (j->secs) {
            j->secs[k] = now() - t0;
        }
    }
    return NULL;
}

static int cmp(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s BYTES THREADS PASSES\n", argv[0]);
        return 2;
    }
    const size_t S = strtoull(argv[1], NULL, 10) & ~(size_t) 4095;
    const int T = atoi(argv[2]), P = atoi(argv[3]);
    uint8_t * buf = aligned_alloc(4096, S);
    for (size_t i = 0; i < S; ++i) {
        buf[i] = (uint8_t) (i*2654435761u >> 24) & 0x3b; // finite fp16 values, no NaN
    }
    for (int mode = 0; mode < 2; ++mode) {
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, (unsigned) T);
        double * secs = calloc((size_t) P, sizeof(double));
        job * jobs = calloc((size_t) T, sizeof(job));
        pthread_t * th = calloc((size_t) T, sizeof(pthread_t));
        const size_t per = S / T / 64 * 64;
        for (int t = 0; t < T; ++t) {
            jobs[t] = (job) { buf + t*per, per, mode, &bar, P, t == 0 ? secs : NULL, 0.0f };
            pthread_create(&th[t], NULL, run, &jobs[t]);
        }
        float sink = 0.0f;
        for (int t = 0; t < T; ++t) {
            pthread_join(th[t], NULL);
            sink += jobs[t].sink;
        }
        qsort(secs, (size_t) P, sizeof(double), cmp);
        printf("{\"mode\": \"%s\", \"threads\": %d, \"bytes\": %zu, \"gbps_median\": %.2f, \"gbps_best\": %.2f, \"sink\": %g}\n",
               mode ? "u8" : "f16", T, per*T, per*T/secs[P/2]/1e9, per*T/secs[0]/1e9, (double) sink);
        free(secs); free(jobs); free(th);
        pthread_barrier_destroy(&bar);
    }
    free(buf);
    return 0;
}
