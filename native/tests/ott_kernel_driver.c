// Runs one generated kernel on data from a file, for architectures the test machine can only emulate
// (NEON under qemu-user). Usage:
//   ott_kernel_driver BITS GROUP ISA quantize   IN(f32...)             OUT(blocks)
//   ott_kernel_driver BITS GROUP ISA dequantize IN(blocks)             OUT(f32...)
//   ott_kernel_driver BITS GROUP ISA vec_dot    IN(i64 n, blocks, q8_1) OUT(f32)
// Exit status 2 on bad usage or I/O, 3 when the kernel is not in the table.
#include "ott-kernels.h"

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

int main(int argc, char ** argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s BITS GROUP ISA quantize|dequantize|vec_dot IN OUT\n", argv[0]);
        return 2;
    }
    const int bits = atoi(argv[1]);
    const int group = atoi(argv[2]);
    int nk = 0;
    const ott_kernel * table = ott_kernels(&nk);
    const ott_kernel * k = NULL;
    for (int i = 0; i < nk; ++i) {
        if (table[i].bits == bits && table[i].group == group && strcmp(table[i].isa, argv[3]) == 0) {
            k = &table[i];
        }
    }
    if (!k) {
        fprintf(stderr, "no kernel for bits=%d group=%d isa=%s\n", bits, group, argv[3]);
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
