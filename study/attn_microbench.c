// Time of the attention partial's sealed-group kernel alone (issue 15, docs/decode-profile.md): one thread,
// NG groups of one KV head sealed from random K/V (rotated V, outliers traced, as the cache runs), then
// attn_group over all of them for NR query rows (decode: the GQA heads of one KV head), repeated.
// Prints one JSON line: ns per group call (the best and the median repetition), the state bytes per group and the
// pooled tokens per group passed to the kernel, for the (K, V) widths given.
// With an 8th argument N_TAIL > 0: the fp16 tail kernel instead, N_TAIL tokens in calls of G (ns per tail).
// Build against a generated ott2-head.c: cc -O3 -march=native -ffp-contract=off -I<gen/ggml> -I native/kernels
//     study/attn_microbench.c <gen/ggml>/ott2-head.c -lm -o attn_microbench
#include "ott2-head.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9*ts.tv_nsec;
}

static uint16_t to_half(float f) { // normal range only: the test data stay within it
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t s = (x >> 16) & 0x8000u, e = (x >> 23) & 0xff, m = x & 0x7fffffu;
    if (e < 113) {
        return (uint16_t) s;
    }
    return (uint16_t) (s | ((e - 112) << 10) | (m >> 13));
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

// the online-softmax states of NR rows, empty
static void reset_rows(int NR, int D, float * M, float * L, float * acc) {
    for (int i = 0; i < NR; ++i) {
        M[i] = -INFINITY;
        L[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float)*NR*D);
}

// "a,b,c" -> up to 8 ints; 1 (a zero) when s is NULL
static int parse_ints(const char * s, int * out) {
    int n = 0;
    while (s && n < 8) {
        out[n++] = atoi(s);
        s = strchr(s, ',');
        s = s ? s + 1 : NULL;
    }
    return n > 0 ? n : 1;
}

int main(int argc, char ** argv) {
    const int kbits = argc > 1 ? atoi(argv[1]) : 2, vbits = argc > 2 ? atoi(argv[2]) : 2;
    const int D = argc > 3 ? atoi(argv[3]) : 64, NR = argc > 4 ? atoi(argv[4]) : 3;
    const int NG = argc > 5 ? atoi(argv[5]) : 32, reps = argc > 6 ? atoi(argv[6]) : 200;
    const int vsym = argc > 7 ? atoi(argv[7]) : 0; // symmetric V blocks (v_sym); keys plain (no k_mix)
    const int n_tail = argc > 8 ? atoi(argv[8]) : 0;
    const ott_head_kernels * hk = ott_head_find(kbits, vbits, 0, vsym);
    if (!hk) {
        return 1;
    }
    const int G = hk->G, O = 3, A = 32, S = O + A;
    const size_t kbytes = (size_t) D*hk->kb, vbytes = (size_t) G*(D/hk->Gv)*hk->vb;
    char * kq = malloc(kbytes*NG), * vq = malloc(vbytes*NG);
    uint16_t * gk = malloc(sizeof(uint16_t)*G*D), * gv = malloc(sizeof(uint16_t)*G*D);
    uint16_t * pool = calloc((size_t) 2*S*D, sizeof(uint16_t));
    ott_slot_meta meta[64];
    int n_pool = 0, n_aux = 0, tracing = 1;
    srand(1);
    for (int g = 0; g < NG; ++g) {
        for (int i = 0; i < G*D; ++i) {
            const float u = (float) rand()/RAND_MAX - 0.5f, w = (float) rand()/RAND_MAX - 0.5f;
            gk[i] = to_half(4.0f*u + (i % D == 3 ? 20.0f : 0.0f)); // one large channel, as real keys have
            gv[i] = to_half(2.0f*w);
        }
        hk->seal(D, gk, gv, g*G, O, A, meta, pool, pool + (size_t) S*D, &n_pool, meta + O, pool + (size_t) O*D,
                 pool + (size_t) (S + O)*D, &n_aux, &tracing, 1, kq + g*kbytes, vq + g*vbytes);
    }
    float * q = malloc(sizeof(float)*NR*D), * acc = malloc(sizeof(float)*NR*D);
    float M[256], L[256];
    float * scratch = malloc(sizeof(float)*(2*G*D + 16));
    for (int i = 0; i < NR*D; ++i) {
        q[i] = (float) rand()/RAND_MAX - 0.5f;
    }
    double best = 1e30;
    float sink = 0.0f;
    if (n_tail > 0) { // the recent window: fp16 rows of D halves, every row sees all of it
        uint16_t * tk = malloc(sizeof(uint16_t)*n_tail*D), * tv = malloc(sizeof(uint16_t)*n_tail*D);
        int32_t qpos[256];
        for (int i = 0; i < n_tail*D; ++i) {
            tk[i] = to_half(4.0f*((float) rand()/RAND_MAX - 0.5f));
            tv[i] = to_half(2.0f*((float) rand()/RAND_MAX - 0.5f));
        }
        for (int i = 0; i < NR; ++i) {
            qpos[i] = n_tail;
        }
        for (int r = 0; r < reps; ++r) {
            reset_rows(NR, D, M, L, acc);
            const double t0 = now();
            for (int j0 = 0; j0 < n_tail; j0 += G) {
                const int n_t = n_tail - j0 < G ? n_tail - j0 : G;
                hk->attn_tail(D, NR, q, qpos, 0.125f, n_t, j0, tk + (size_t) j0*D, tv + (size_t) j0*D, D, M, L, acc,
                              scratch);
            }
            const double t = now() - t0;
            best = t < best ? t : best;
            sink += acc[0]/L[0];
        }
        printf("{\"D\": %d, \"rows\": %d, \"tail\": %d, \"ns_per_tail\": %.1f, \"isa\": \"%s\", \"sink\": %g}\n", D, NR,
               n_tail, best*1e9, ott2_head_isa(), (double) sink);
        return 0;
    }
    // the pooled tokens of a group are passed to the kernel as the op passes them (0.3-0.45 per group here with
    // the default pool of 3 + 32; covers_per_group reports it); OTT_MB_COVERS=0 leaves them out (as before 2026-11-28)
    const char * cov_env = getenv("OTT_MB_COVERS");
    const int covers = !cov_env || atoi(cov_env);
    uint16_t * ck = malloc(sizeof(uint16_t)*S*D), * cv = malloc(sizeof(uint16_t)*S*D);
    // OTT_MB_EVICT=MB: before each repetition (untimed), a line of every 64 bytes of an MB buffer is written, as the
    // weights stream through the caches between two layers' attention in the model: each pass then starts with the
    // kernel's code, its scratch and the state out of cache (2026-11-28: about 12.5 us per call at D 256 in the
    // model against 6-7 alone)
    const char * ev_env = getenv("OTT_MB_EVICT");
    const size_t ev_n = ev_env ? (size_t) atoi(ev_env) << 20 : 0;
    char * ev = ev_n ? calloc(ev_n, 1) : NULL;
    const char * pf_env = getenv("OTT_MB_OP_PREFETCH"); // 1: the next group into L2 before each call, as the op did
    const int op_pf = pf_env && atoi(pf_env);
    // OTT_MB_SLICE=SG[,SG...] with OTT_MB_AHEAD=A[,A...]: the groups in the op's slices of SG groups, even slices
    // then odd ones (what one of two threads sees), each slice's first group prefetched by a burst before it as the
    // op does, and with A > 0 the first groups of the A slices after it too. Several configurations alternate rep
    // by rep over the same buffers (this machine's DRAM rate moves between processes), one best time each.
    int sgs[8] = {0}, aheads[8] = {0};
    const int n_sg = parse_ints(getenv("OTT_MB_SLICE"), sgs), n_ah = parse_ints(getenv("OTT_MB_AHEAD"), aheads);
    const int n_conf = n_sg > n_ah ? n_sg : n_ah;
    double bests[8] = {1e30, 1e30, 1e30, 1e30, 1e30, 1e30, 1e30, 1e30};
    double * times = malloc(sizeof(double)*reps); // configuration 0's repetitions, for the median
    long n_covers = 0;
    for (int r = 0; r < reps*n_conf; ++r) {
        const int conf = r % n_conf, SG = sgs[conf], ahead = aheads[conf];
        const int n_sl = SG > 0 ? (NG + SG - 1)/SG : 0;
        reset_rows(NR, D, M, L, acc);
        for (size_t i = 0; i < ev_n; i += 64) {
            ev[i] += 1;
        }
        const double t0 = now();
        for (int gi = 0; gi < NG; ++gi) {
            int g = gi;
            if (SG > 0) {
                const int k = gi/SG, sl = k < (n_sl + 1)/2 ? 2*k : 2*(k - (n_sl + 1)/2) + 1;
                g = sl*SG + gi % SG;
                if (g >= NG) {
                    continue;
                }
                if (gi % SG == 0) {
                    for (int a = 0; a <= ahead; ++a) { // this slice's first group; with ahead, the next slice's too
                        const int ka = k + a, sa = ka < (n_sl + 1)/2 ? 2*ka : 2*(ka - (n_sl + 1)/2) + 1;
                        if (a > 0 && (ka >= n_sl || sa*SG >= NG)) {
                            break;
                        }
                        const size_t ga = (size_t) sa*SG;
                        for (size_t o = 0; o < kbytes; o += 64) {
                            __builtin_prefetch((const char *) kq + ga*kbytes + o, 0, 1);
                        }
                        for (size_t o = 0; o < vbytes; o += 64) {
                            __builtin_prefetch((const char *) vq + ga*vbytes + o, 0, 1);
                        }
                    }
                }
            }
            for (size_t o = 0; op_pf && g + 1 < NG && o < kbytes; o += 64) {
                __builtin_prefetch((const char *) kq + (g + 1)*kbytes + o, 0, 1);
            }
            for (size_t o = 0; op_pf && g + 1 < NG && o < vbytes; o += 64) {
                __builtin_prefetch((const char *) vq + (g + 1)*vbytes + o, 0, 1);
            }
            int32_t cj[64];
            int nc = 0;
            for (int i = 0; i < n_pool + n_aux; ++i) {
                const int slot = i < n_pool ? i : O + (i - n_pool);
                if (meta[slot].pos >= g*G && meta[slot].pos < (g + 1)*G) {
                    // cover rows, gathered as the op gathers them: the slot's exact K and V
                    memcpy(ck + (size_t) nc*D, pool + (size_t) slot*D, sizeof(uint16_t)*D);
                    memcpy(cv + (size_t) nc*D, pool + (size_t) (S + slot)*D, sizeof(uint16_t)*D);
                    cj[nc++] = meta[slot].pos - g*G;
                }
            }
            hk->attn_group(D, NR, q, 0.125f, kq + g*kbytes, vq + g*vbytes, covers ? nc : 0, cj, ck, cv, 1, M, L,
                           acc, scratch);
            n_covers += r == 0 && covers ? nc : 0;
        }
        const double t = now() - t0;
        bests[conf] = t < bests[conf] ? t : bests[conf];
        if (conf == 0) {
            times[r/n_conf] = t;
        }
        best = bests[0];
        sink += acc[0]/L[0];
    }
    for (int c = 0; n_conf > 1 && c < n_conf; ++c) {
        printf("{\"slice\": %d, \"ahead\": %d, \"ns_per_group\": %.1f}\n", sgs[c], aheads[c], bests[c]/NG*1e9);
    }
    qsort(times, reps, sizeof(double), cmp_double);
    printf("{\"kbits\": %d, \"vbits\": %d, \"D\": %d, \"rows\": %d, \"groups\": %d, \"ns_per_group\": %.1f, "
           "\"ns_per_group_median\": %.1f, \"bytes_per_group\": %zu, \"GBps\": %.2f, \"covers_per_group\": %.2f, "
           "\"isa\": \"%s\", \"sink\": %g}\n", kbits, vbits, D, NR, NG, best/NG*1e9, times[reps/2]/NG*1e9,
           kbytes + vbytes, (kbytes + vbytes)/(best/NG)/1e9, (double) n_covers/NG, ott2_head_isa(), (double) sink);
    return 0;
}
