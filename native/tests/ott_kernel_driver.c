// Runs one generated kernel on data from a file, for architectures the test machine can only emulate
// (NEON under qemu-user). Usage:
//   ott_kernel_driver BITS[s] GROUP[cCLIP] ISA quantize   IN(f32...)             OUT(blocks)
//   ott_kernel_driver BITS[s] GROUP[cCLIP] ISA dequantize IN(blocks)             OUT(f32...)
//   ott_kernel_driver BITS[s] GROUP[cCLIP] ISA vec_dot    IN(i64 n, blocks, q8_1) OUT(f32)
//   ott_kernel_driver head KBITS[m] VBITS[s] G GV ISA VROT seal IN OUT   per-head seal (layouts: see head_seal)
//   ott_kernel_driver head KBITS[m] VBITS[s] G GV ISA VROT attn IN OUT   per-head attention (see head_attn)
//   ott_kernel_driver head KBITS[m] VBITS[s] G GV ISA VROT rows IN OUT   multi-row attention (see head_rows)
// (block kernels: "2s" a symmetric format, "64c37" a group of 64 clipped to 37/64 of its range, 64 without;
// head kernels: K codes of KBITS bits in blocks of G tokens ("3m": widths per channel), V codes of VBITS bits in
// blocks of GV channels ("2s": symmetric blocks); VROT 1: V stored rotated, 0: plain)
// Exit status 2 on bad usage or I/O, 3 when the kernel is not in the table.
#include "ott-kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char * read_all(const char * path, size_t * n) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char * buf = malloc((size_t) size + 64);
    if (buf && fread(buf, 1, (size_t) size, f) != (size_t) size) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *n = (size_t) size;
    return buf;
}

static int write_all(const char * path, const void * data, size_t n) {
    FILE * f = fopen(path, "wb");
    if (!f) {
        return 0;
    }
    const int ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

typedef struct {
    const unsigned char * p;
    const unsigned char * end;
} reader;

static const void * take(reader * r, size_t n) {
    const void * q = r->p;
    if ((size_t) (r->end - r->p) < n) {
        fprintf(stderr, "input too short\n");
        exit(2);
    }
    r->p += n;
    return q;
}

// IN:  int32 {D, pos0, outlier_num, aux_cap, n_pool, n_aux, tracing, 0}, gk, gv (G*D u16 each),
//      pool: n_pool x {i32 pos, f32 score}, n_pool*D u16 K, n_pool*D u16 V; aux: the same with n_aux
// OUT: int32 {n_won, n_pool, n_aux, tracing}, kq (D blocks), vq (G*D/Gv blocks), pool, aux (as in IN)
// bytes of one head's sealed K group (k_mix: the channel blocks plus their 2-bit width table)
static size_t kgroup_bytes(const ott_head_kernel * k, int D) {
    return (size_t) D*k->k_block_bytes + (k->kmix ? (size_t) D/4 : 0);
}

static int head_seal(const ott_head_kernel * k, int vrot, const unsigned char * in, size_t n_in,
                     const char * out_path) {
    reader r = { in, in + n_in };
    int32_t h[8];
    memcpy(h, take(&r, sizeof(h)), sizeof(h));
    const int D = h[0], G = k->G;
    int n_pool = h[4], n_aux = h[5], tracing = h[6];
    const int cap_p = h[2] > 0 ? h[2] : 1, cap_a = h[3] > 0 ? h[3] : 1;
    uint16_t * gk = malloc((size_t) G*D*2);
    uint16_t * gv = malloc((size_t) G*D*2);
    memcpy(gk, take(&r, (size_t) G*D*2), (size_t) G*D*2);
    memcpy(gv, take(&r, (size_t) G*D*2), (size_t) G*D*2);
    ott_slot_meta * pm = calloc((size_t) cap_p, sizeof(ott_slot_meta));
    ott_slot_meta * am = calloc((size_t) cap_a, sizeof(ott_slot_meta));
    uint16_t * pk = calloc((size_t) cap_p*D, 2), * pv = calloc((size_t) cap_p*D, 2);
    uint16_t * ak = calloc((size_t) cap_a*D, 2), * av = calloc((size_t) cap_a*D, 2);
    memcpy(pm, take(&r, (size_t) n_pool*sizeof(ott_slot_meta)), (size_t) n_pool*sizeof(ott_slot_meta));
    memcpy(pk, take(&r, (size_t) n_pool*D*2), (size_t) n_pool*D*2);
    memcpy(pv, take(&r, (size_t) n_pool*D*2), (size_t) n_pool*D*2);
    memcpy(am, take(&r, (size_t) n_aux*sizeof(ott_slot_meta)), (size_t) n_aux*sizeof(ott_slot_meta));
    memcpy(ak, take(&r, (size_t) n_aux*D*2), (size_t) n_aux*D*2);
    memcpy(av, take(&r, (size_t) n_aux*D*2), (size_t) n_aux*D*2);
    const size_t kq_n = kgroup_bytes(k, D), vq_n = (size_t) G*(D/k->Gv)*k->v_block_bytes;
    unsigned char * kq = malloc(kq_n), * vq = malloc(vq_n);
    const int n_won = k->seal(D, gk, gv, h[1], h[2], h[3], pm, pk, pv, &n_pool, am, ak, av, &n_aux, &tracing, vrot,
                              kq, vq);
    FILE * f = fopen(out_path, "wb");
    if (!f) {
        return 0;
    }
    const int32_t o[4] = { n_won, n_pool, n_aux, tracing };
    fwrite(o, sizeof(o), 1, f);
    fwrite(kq, 1, kq_n, f);
    fwrite(vq, 1, vq_n, f);
    fwrite(pm, sizeof(ott_slot_meta), (size_t) n_pool, f);
    fwrite(pk, 2, (size_t) n_pool*D, f);
    fwrite(pv, 2, (size_t) n_pool*D, f);
    fwrite(am, sizeof(ott_slot_meta), (size_t) n_aux, f);
    fwrite(ak, 2, (size_t) n_aux*D, f);
    fwrite(av, 2, (size_t) n_aux*D, f);
    return fclose(f) == 0;
}

// IN:  int32 {D, q_pos, n_sealed, n_pooled, n_tail, tail_pos0}, f32 scale, f32 q[D], kq, vq (n_sealed groups),
//      i32 pooled_pos[n_pooled], u16 pooled_k, pooled_v [n_pooled*D], u16 tail_k, tail_v [n_tail*D]
// OUT: f32 out[D]
static int head_attn(const ott_head_kernel * k, int vrot, const unsigned char * in, size_t n_in,
                     const char * out_path) {
    reader r = { in, in + n_in };
    int32_t h[6];
    memcpy(h, take(&r, sizeof(h)), sizeof(h));
    float scale;
    memcpy(&scale, take(&r, 4), 4);
    const int D = h[0], G = k->G;
    const float * q = take(&r, (size_t) D*4);
    const void * kq = take(&r, (size_t) h[2]*kgroup_bytes(k, D));
    const void * vq = take(&r, (size_t) h[2]*G*(D/k->Gv)*k->v_block_bytes);
    const int32_t * pp = take(&r, (size_t) h[3]*4);
    const uint16_t * pk = take(&r, (size_t) h[3]*D*2);
    const uint16_t * pv = take(&r, (size_t) h[3]*D*2);
    const uint16_t * tk = take(&r, (size_t) h[4]*D*2);
    const uint16_t * tv = take(&r, (size_t) h[4]*D*2);
    float * out = malloc((size_t) D*4);
    k->attn(D, q, h[1], scale, h[2], kq, vq, h[3], pp, pk, pv, h[4], h[5], tk, tv, D, vrot, out);
    return write_all(out_path, out, (size_t) D*4);
}

// IN:  int32 {D, n_rows, n_sealed, n_pooled, n_tail, tail_pos0}, f32 scale, f32 q[n_rows*D], i32 q_pos[n_rows],
//      kq, vq, pooled and tail as for head_attn
// OUT: f32 out[n_rows*D]: the multi-row kernels driven group by group, then (rotated V: each row's acc turned
//      back by unrotate) tail tile by tail tile, as tests/native_kernels.py HeadKernelSet.attn_rows drives them
static int head_rows(const ott_head_kernel * k, int vrot, const unsigned char * in, size_t n_in,
                     const char * out_path) {
    reader r = { in, in + n_in };
    int32_t h[6];
    memcpy(h, take(&r, sizeof(h)), sizeof(h));
    float scale;
    memcpy(&scale, take(&r, 4), 4);
    const int D = h[0], n_rows = h[1], n_sealed = h[2], n_pooled = h[3], n_tail = h[4], G = k->G;
    const float * q = take(&r, (size_t) n_rows*D*4);
    const int32_t * q_pos = take(&r, (size_t) n_rows*4);
    const size_t kbytes = kgroup_bytes(k, D), vbytes = (size_t) G*(D/k->Gv)*k->v_block_bytes;
    const unsigned char * kq = take(&r, (size_t) n_sealed*kbytes);
    const unsigned char * vq = take(&r, (size_t) n_sealed*vbytes);
    const int32_t * pp = take(&r, (size_t) n_pooled*4);
    const uint16_t * pk = take(&r, (size_t) n_pooled*D*2);
    const uint16_t * pv = take(&r, (size_t) n_pooled*D*2);
    const uint16_t * tk = take(&r, (size_t) n_tail*D*2);
    const uint16_t * tv = take(&r, (size_t) n_tail*D*2);
    float * M = malloc((size_t) n_rows*4);
    float * L = calloc((size_t) n_rows, 4);
    float * acc = calloc((size_t) n_rows*D, 4);
    float * scratch = malloc((size_t) 2*G*D*4);
    int32_t * cj = malloc((size_t) (n_pooled + 1)*4);
    uint16_t * ck = malloc((size_t) (n_pooled + 1)*D*2);
    uint16_t * cv = malloc((size_t) (n_pooled + 1)*D*2);
    for (int i = 0; i < n_rows; ++i) {
        M[i] = -INFINITY;
    }
    for (int g = 0; g < n_sealed; ++g) {
        int nc = 0;
        for (int i = 0; i < n_pooled; ++i) {
            if (pp[i] >= g*G && pp[i] < (g + 1)*G) {
                cj[nc] = pp[i] - g*G;
                memcpy(ck + (size_t) nc*D, pk + (size_t) i*D, (size_t) D*2);
                memcpy(cv + (size_t) nc*D, pv + (size_t) i*D, (size_t) D*2);
                nc++;
            }
        }
        k->attn_group(D, n_rows, q, scale, kq + g*kbytes, vq + g*vbytes, nc, cj, ck, cv, vrot, M, L, acc, scratch);
    }
    if (vrot) { // the sealed groups' states are in the rotated basis: turned back once per row
        for (int i = 0; i < n_rows; ++i) {
            k->unrotate(D, acc + (size_t) i*D);
        }
    }
    for (int j0 = 0; j0 < n_tail; j0 += G) {
        const int n_t = n_tail - j0 < G ? n_tail - j0 : G;
        k->attn_tail(D, n_rows, q, q_pos, scale, n_t, h[5] + j0, tk + (size_t) j0*D, tv + (size_t) j0*D, D,
                     M, L, acc, scratch);
    }
    for (int i = 0; i < n_rows; ++i) {
        for (int c = 0; c < D; ++c) {
            acc[(size_t) i*D + c] /= L[i];
        }
    }
    return write_all(out_path, acc, (size_t) n_rows*D*4);
}

static int head_main(int argc, char ** argv) {
    if (argc != 11) {
        fprintf(stderr, "usage: %s head KBITS[m] VBITS[s] G GV ISA VROT seal|attn|rows IN OUT\n", argv[0]);
        return 2;
    }
    const int kbits = atoi(argv[2]), vbits = atoi(argv[3]), G = atoi(argv[4]), Gv = atoi(argv[5]);
    const int kmix = strchr(argv[2], 'm') != NULL; // "3m": K widths per channel
    const int vsym = strchr(argv[3], 's') != NULL; // "2s": symmetric V blocks
    const int vrot = atoi(argv[7]) != 0;
    int nk = 0;
    const ott_head_kernel * table = ott_head_kernels(&nk);
    const ott_head_kernel * k = NULL;
    for (int i = 0; i < nk; ++i) {
        if (table[i].kbits == kbits && table[i].vbits == vbits && table[i].G == G && table[i].Gv == Gv &&
            table[i].kmix == kmix && table[i].vsym == vsym && strcmp(table[i].isa, argv[6]) == 0) {
            k = &table[i];
        }
    }
    if (!k) {
        fprintf(stderr, "no head kernel for K %d bits, V %d bits, G=%d, Gv=%d, isa=%s\n", kbits, vbits, G, Gv,
                argv[6]);
        return 3;
    }
    size_t n_in = 0;
    unsigned char * in = read_all(argv[9], &n_in);
    if (!in) {
        fprintf(stderr, "cannot read %s\n", argv[9]);
        return 2;
    }
    int ok = 0;
    if (strcmp(argv[8], "seal") == 0) {
        ok = head_seal(k, vrot, in, n_in, argv[10]);
    } else if (strcmp(argv[8], "attn") == 0) {
        ok = head_attn(k, vrot, in, n_in, argv[10]);
    } else if (strcmp(argv[8], "rows") == 0) {
        ok = head_rows(k, vrot, in, n_in, argv[10]);
    } else {
        fprintf(stderr, "unknown head op %s\n", argv[8]);
        return 2;
    }
    return ok ? 0 : 2;
}

int main(int argc, char ** argv) {
    if (argc > 1 && strcmp(argv[1], "head") == 0) {
        return head_main(argc, argv);
    }
    if (argc != 7) {
        fprintf(stderr, "usage: %s BITS[s] GROUP[cCLIP] ISA quantize|dequantize|vec_dot IN OUT\n", argv[0]);
        return 2;
    }
    const int bits = atoi(argv[1]);
    const int sym = strchr(argv[1], 's') != NULL; // "2s": symmetric blocks
    const int group = atoi(argv[2]);
    const char * c = strchr(argv[2], 'c');        // "64c37": clipped to 37/64 of the range
    const int clip = c ? atoi(c + 1) : 64;
    int nk = 0;
    const ott_kernel * table = ott_kernels(&nk);
    const ott_kernel * k = NULL;
    for (int i = 0; i < nk; ++i) {
        if (table[i].bits == bits && table[i].group == group && table[i].clip == clip && table[i].sym == sym &&
            strcmp(table[i].isa, argv[3]) == 0) {
            k = &table[i];
        }
    }
    if (!k) {
        fprintf(stderr, "no kernel for bits=%d%s group=%d clip=%d isa=%s\n", bits, sym ? " (symmetric)" : "", group,
                clip, argv[3]);
        return 3;
    }
    size_t n_in = 0;
    unsigned char * in = read_all(argv[5], &n_in);
    if (!in) {
        fprintf(stderr, "cannot read %s\n", argv[5]);
        return 2;
    }
    int ok = 0;
    if (strcmp(argv[4], "quantize") == 0) {
        const int64_t n = (int64_t) (n_in / sizeof(float));
        const size_t out_n = (size_t) (n / group) * k->block_bytes;
        void * out = malloc(out_n + 1);
        k->quantize((const float *) in, out, n);
        ok = write_all(argv[6], out, out_n);
        free(out);
    } else if (strcmp(argv[4], "dequantize") == 0) {
        const int64_t n = (int64_t) (n_in / k->block_bytes) * group;
        float * out = malloc((size_t) n * sizeof(float) + 1);
        k->dequantize(in, out, n);
        ok = write_all(argv[6], out, (size_t) n * sizeof(float));
        free(out);
    } else if (strcmp(argv[4], "vec_dot") == 0) {
        int64_t n;
        memcpy(&n, in, sizeof(n));
        const unsigned char * x = in + sizeof(n);
        const unsigned char * y = x + (size_t) (n / group) * k->block_bytes;
        float s = 0.0f;
        k->vec_dot_q8_1((int) n, &s, 0, x, 0, y, 0, 1);
        ok = write_all(argv[6], &s, sizeof(s));
    } else {
        fprintf(stderr, "unknown op %s\n", argv[4]);
        free(in);
        return 2;
    }
    free(in);
    return ok ? 0 : 2;
}
