// ott-bench: the ott2 cache's CUDA ops (gen/templates/ott_cuda_ops.j2) timed alone, on random valid state at the
// shapes and depths of the decode benchmarks (docs/cuda-harness.md). The generated units are included here so
// that their `static __global__` kernels can be named (resources, occupancy; the attention partials' kernel of a
// head dimension through _attn_part_kernel); the launchers are the ones
// ggml-cuda calls (ggml-cuda-ott.cu), so a launch here is a launch of `-ctk ott2 -ctv ott2`.
//   ott-bench [--plan|--emu] [smol|llama8b|all] [4096|32768|all] [ott2|ott2u|quality|all]
// Built by native/tests/build-ott-bench.sh (make cuda-bench); exit status 0, or 1 with the reason on stderr.
#include "ott2-cuda-k2mv2g128x64.cu"
#include "ott2-cuda-k2v2g128x64.cu"
#include "ott2-cuda-k3mv2sg128x64.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// any CUDA error ends the run, naming the call (exit status 1)
#define OTT_CHECK(x)                                                                                         \
    do {                                                                                                     \
        const cudaError_t err_ = (x);                                                                        \
        if (err_ != cudaSuccess) {                                                                           \
            fprintf(stderr, "ott-bench: %s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)
#define OTT_ASSERT(x)                                                                              \
    do {                                                                                           \
        if (!(x)) {                                                                                \
            fprintf(stderr, "ott-bench: %s:%d: assertion failed: %s\n", __FILE__, __LINE__, #x); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

typedef void (*ott_bench_launcher)(const ott_cu_args * a, void * stream);
typedef void (*ott_bench_kernel)(const ott_cu_args a);
typedef void (*ott_bench_kernel_fused)(const ott_cu_args a, const int64_t n_merge);

// one cache config: the head config's ops and the llama_ott_config values that shape the state
struct ott_bench_cfg {
    const char * name;
    const char * tag;
    int32_t kmix, vsym;        // K widths per channel (K bits +- 1), symmetric V blocks
    int32_t KB, VB;            // bytes of a K block at the nominal width, of a V block
    int32_t G, Gv, R, O, aux;  // llama_ott_config: G, R, outlier_num, aux_cap (Gv: the head config's)
    ott_bench_launcher part, merge, seal, fused;     // the launchers ggml-cuda calls (fused: merge and seal)
    ott_bench_launcher epart, emerge, eseal, efused; // their CPU emulation (--emu)
    const void * (*kpart)(int32_t D, int32_t * threads, const char ** targs); // the partials' kernel at D
    const void * kmerge, * kseal, * kfused;          // the other kernels
};

// a head config TAG (gen/generate.py's HeadConfig.tag) of G 128, Gv 64 with the cache's outlier_num 3 and aux_cap 32;
// the static kernels are picked from their launchers (same name) by type
#define OTT_BENCH_CFG(NAME, TAG, KMIX, VSYM, R)                                                                    \
    { NAME, #TAG, KMIX, VSYM, (int32_t) sizeof(ott2_cuda_##TAG##_kblock), (int32_t) sizeof(ott2_cuda_##TAG##_vblock), \
      128, 64, R, 3, 32,                                                                                           \
      ott2_cuda_##TAG##_attn_part, ott2_cuda_##TAG##_attn_merge, ott2_cuda_##TAG##_seal,                           \
      ott2_cuda_##TAG##_attn_merge_seal,                                                                           \
      ott2_emu_##TAG##_attn_part, ott2_emu_##TAG##_attn_merge, ott2_emu_##TAG##_seal,                              \
      ott2_emu_##TAG##_attn_merge_seal,                                                                            \
      ott2_cuda_##TAG##_attn_part_kernel,                                                                          \
      (const void *) static_cast<ott_bench_kernel>(ott2_cuda_##TAG##_attn_merge),                                  \
      (const void *) static_cast<ott_bench_kernel>(ott2_cuda_##TAG##_seal),                                        \
      (const void *) static_cast<ott_bench_kernel_fused>(ott2_cuda_##TAG##_attn_merge_seal) }

// llama_ott_config_default (native/src/llama-ott.cpp): G 128, R 32, outlier_num 3, aux_cap 32, v_rotate 1, k_mix 2
// (2-bit keys of widths 1/2/3 per channel) and v_sym off, so `-ctk ott2 -ctv ott2` runs k2mv2g128x64; ott2u is
// ott2 with uniform 2-bit keys (k_mix 1: `--ott-params 128,32,3,32,2,1,1,0`, the default before 2026-11-29). The
// quality tier (docs/tiers.md: -ctk ott3 -ctv ott2 --ott-params 128,64,3,32,2,1,1,1): R 64, k_mix and v_sym on.
static const ott_bench_cfg cfgs[] = {
    OTT_BENCH_CFG("ott2",    k2mv2g128x64,  1, 0, 32),
    OTT_BENCH_CFG("ott2u",   k2v2g128x64,   0, 0, 32),
    OTT_BENCH_CFG("quality", k3mv2sg128x64, 1, 1, 64),
};

struct ott_bench_shape {
    const char * name;
    int32_t H, n_head, D;
};
static const ott_bench_shape shapes[] = {
    { "smol",    3,  9,  64 }, // SmolLM2-135M
    { "llama8b", 8, 32, 128 }, // Llama-3-8B
};
static const int32_t depths[] = { 4096, 32768 };

// the slicing rule of ggml_ott_attn_slices (native/ggml/ggml-ott.c, OTT_SLICE_GROUPS 4, OTT_MAX_SLICES 32)
#define OTT_MAX_SLICES_BENCH 32
static int32_t ott_bench_slices(int32_t NG) {
    const int32_t ns = (NG + 4 - 1)/4;
    return ns < 1 ? 1 : ns > 32 ? 32 : ns;
}

// ---- where the buffers live: the GPU, or with --emu the host, for the kernels' CPU emulation (ott2-emu-<tag>.cpp,
// the same kernel bodies): the state and the checks of a GPU run, run here without a GPU
static bool emu = false;

template <typename T> static T * buf_alloc(size_t n) {
    const size_t bytes = std::max<size_t>(n, 1)*sizeof(T);
    void * p = nullptr;
    if (emu) {
        p = calloc(1, bytes);
        OTT_ASSERT(p != nullptr);
    } else {
        OTT_CHECK(cudaMalloc(&p, bytes));
    }
    return (T *) p;
}
static void buf_free(void * p) {
    if (emu) {
        free(p);
    } else {
        OTT_CHECK(cudaFree(p));
    }
}
// every byte of a buffer set to `byte`
static void buf_fill(void * p, int byte, size_t bytes) {
    if (emu) {
        memset(p, byte, bytes);
    } else {
        OTT_CHECK(cudaMemset(p, byte, bytes));
    }
}
// the host's copies (to_buf, from_buf, buf_fill: the legacy stream) and the launches on the harness's non-blocking
// stream ordered: everything before done
static void buf_sync(void) {
    if (!emu) {
        OTT_CHECK(cudaDeviceSynchronize());
    }
}
static void to_buf(void * dst, const void * src, size_t bytes) {
    if (emu) {
        memcpy(dst, src, bytes);
    } else {
        OTT_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    }
}
static void from_buf(void * dst, const void * src, size_t bytes) {
    if (emu) {
        memcpy(dst, src, bytes);
    } else {
        OTT_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    }
}

// ---- host-side random state (seeded per case: a case's bytes do not depend on the cases run before it)
static uint64_t rng_state = 0;
static uint64_t rng_u64(void) { // splitmix64
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30))*0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27))*0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_uniform(float lo, float hi) {
    return lo + (hi - lo)*(float) ((rng_u64() >> 40)*(1.0/16777216.0));
}
static uint16_t f2h_bits(float x) {
    const half h = __float2half_rn(x);
    uint16_t b;
    memcpy(&b, &h, sizeof(b));
    return b;
}
static void put_u16(uint8_t * p, uint16_t x) { memcpy(p, &x, sizeof(x)); }

// the timed rows: the partials, the merge, the seal (a decode step: nothing to seal), a sealing event, and the merge
// and the seal in one launch (ott2_cu_ops.attn_merge_seal, what ggml-cuda runs at decode) at a decode step and at a
// sealing event; the partials again with only their sealed groups (part_sealed: no ring but the token) and with
// only their fp16 tail (part_tail: the ring, nothing sealed), which say which kind of block sets the launch's time;
// each row's kernel (its resources: kernel_res)
enum { R_PART, R_MERGE, R_SEAL, R_EVENT, R_FUSED, R_FUSED_EVENT, R_PART_SEALED, R_PART_TAIL, N_ROWS };
enum { K_PART, K_MERGE, K_SEAL, K_FUSED, N_KERNELS };
static const char * const kernel_names[N_ROWS] = { "attn_part", "attn_merge", "seal", "seal_event", "merge_seal",
                                                   "merge_seal_event", "part_sealed", "part_tail" };
static const int kernel_res[N_ROWS] = { K_PART, K_MERGE, K_SEAL, K_SEAL, K_FUSED, K_FUSED, K_PART, K_PART };
static const char * const kernel_fn[N_KERNELS] = { "attn_part", "attn_merge", "seal", "attn_merge_seal" };

// sizes and plans of one (config, shape, depth), as the cache computes them (llama-kv-cache-ott.cpp/.h)
struct ott_bench_case {
    const ott_bench_cfg * cfg;
    const ott_bench_shape * shape;
    int32_t depth, n_tok, n_ctx, T, S, NG, NS;
    int32_t n_sealed, n_sealed_after;          // the ubatch of n_tok tokens at position `depth` (decode: n_tok 1)
    int32_t seal_pos, seal_from, seal_to;      // the token whose decode seals a group, and its plan
    size_t kgb, vgb;                           // bytes of one head's sealed K group, V group
    int64_t grid[N_ROWS];                      // blocks of each row's launch
    double bytes[N_ROWS];                      // bytes it moves at least
};

// at: the ubatch's first position (default: the depth); n_ctx is sized by the depth either way
static ott_bench_case make_case(const ott_bench_cfg * cfg, const ott_bench_shape * shape, int32_t depth,
                                int32_t n_tok = 1, int32_t at = -1) {
    ott_bench_case c = {};
    c.cfg = cfg;
    c.shape = shape;
    // llama-bench -d depth -n 16 (a prefill ubatch: -p n_tok): n_ctx = depth + 16 (n_tok), padded to 256 by llama.cpp
    c.n_ctx = (depth + std::max(16, n_tok) + 255)/256*256;
    depth = at >= 0 ? at : depth;
    c.depth = depth;
    c.n_tok = n_tok;
    c.T = cfg->R + cfg->G;
    c.S = std::max(1, cfg->O + cfg->aux);
    c.NG = std::max(1, (c.n_ctx - cfg->R)/cfg->G);
    c.NS = ott_bench_slices(c.NG);
    auto sealed_at = [&](int32_t p) { return p >= cfg->R ? (p - cfg->R)/cfg->G : 0; };
    c.n_sealed = sealed_at(depth);
    c.n_sealed_after = std::max(c.n_sealed, sealed_at(depth + n_tok));
    // sealing event: group n_sealed seals when the token at R + (n_sealed + 1)*G - 1 is decoded
    c.seal_from = c.n_sealed;
    c.seal_to = c.n_sealed + 1;
    c.seal_pos = cfg->R + c.seal_to*cfg->G - 1;
    OTT_ASSERT(sealed_at(c.seal_pos) == c.seal_from && sealed_at(c.seal_pos + 1) == c.seal_to);
    OTT_ASSERT(c.seal_to <= c.NG && c.seal_pos < c.n_ctx);
    const int32_t D = shape->D;
    c.kgb = (size_t) D*cfg->KB + (cfg->kmix ? (size_t) D/4 : 0);
    c.vgb = (size_t) cfg->G*(D/cfg->Gv)*cfg->VB;
    // the launchers' grids (ott_cuda_ops.j2) at ns = n_tok = 1: attn_part a block per (KV head, sealed slice),
    // serving the KV head's gq query heads, and per (KV head, query head) of the fp16 tail
    const int32_t H = shape->H, gq = shape->n_head/H, G = cfg->G;
    c.grid[R_PART] = c.grid[R_PART_SEALED] = c.grid[R_PART_TAIL] = (int64_t) H*(c.NS + gq)*((n_tok + OTT_TC - 1)/OTT_TC);
    c.grid[R_MERGE] = shape->n_head;
    c.grid[R_SEAL] = c.grid[R_EVENT] = H;
    c.grid[R_FUSED] = c.grid[R_FUSED_EVENT] = shape->n_head + H;
    // bytes each launch has to move at least, each once. attn_part: the sealed groups' K and V codes and scales, the pool rows and metadata,
    // the ring tail; merge: the partials in, the output out; seal: the token's K and V in, their ring rows out;
    // sealing event: that, plus the group's ring rows in and its codes out.
    const int32_t n_pooled = cfg->O + cfg->aux/2, n_ring = depth - c.n_sealed*G;
    c.bytes[R_PART_SEALED] = (double) c.n_sealed*H*(c.kgb + c.vgb) + (double) H*n_pooled*2*D*2 + (double) H*(2*c.S + 3)*4;
    c.bytes[R_PART_TAIL] = (double) H*n_ring*2*D*2;
    c.bytes[R_PART] = c.bytes[R_PART_SEALED] + c.bytes[R_PART_TAIL];
    c.bytes[1] = (double) (D + 2)*gq*H*(c.NS + 1)*4 + (double) D*shape->n_head*4;
    c.bytes[2] = (double) H*D*2*4 + (double) H*D*2*2;
    c.bytes[3] = c.bytes[2] + (double) H*2*G*D*2 + (double) H*(c.kgb + c.vgb);
    c.bytes[R_FUSED] = c.bytes[R_MERGE] + c.bytes[R_SEAL];
    c.bytes[R_FUSED_EVENT] = c.bytes[R_MERGE] + c.bytes[R_EVENT];
    return c;
}

// device buffers of one case, sized as the kernels index them (the OTT_CU_TEST_API block's _run)
struct ott_bench_bufs {
    float * q, * k, * v, * part, * out;
    uint16_t * ring, * pkv, * pkv0, * scratch;
    uint8_t * sk, * sv;
    int32_t * pmeta, * pmeta0, * plan, * flags;
    size_t n_q, n_kv, n_ring, n_sk, n_sv, n_pkv, n_pmeta, n_part, n_out, n_scratch;
};

// random valid state: codes random, fp16 scales finite (V: most units flagged rotated, v_rotate is on), pool
// and aux rows at distinct sorted positions of the sealed range with scores near the low tail of a group's
// (a sealing event keeps some members and takes some new tokens), tracing on
static void fill_state(const ott_bench_case & c, ott_bench_bufs & b) {
    const ott_bench_cfg & cfg = *c.cfg;
    const int32_t D = c.shape->D, H = c.shape->H, G = cfg.G, S = c.S;
    rng_state = 0x9e3779b97f4a7c15ull ^ ((uint64_t) (c.cfg - cfgs) << 40) ^ ((uint64_t) D << 32) ^ (uint64_t) c.depth;
    std::vector<float> f(std::max(b.n_q, b.n_kv));
    for (size_t i = 0; i < b.n_q; ++i) {
        f[i] = rng_uniform(-1.0f, 1.0f);
    }
    to_buf(b.q, f.data(), b.n_q*sizeof(float));
    for (float * dst : { b.k, b.v }) {
        for (size_t i = 0; i < b.n_kv; ++i) {
            f[i] = rng_uniform(-1.0f, 1.0f);
        }
        to_buf(dst, f.data(), b.n_kv*sizeof(float));
    }
    std::vector<uint16_t> h(std::max(b.n_ring, b.n_pkv));
    for (size_t i = 0; i < b.n_ring; ++i) {
        h[i] = f2h_bits(rng_uniform(-1.0f, 1.0f));
    }
    to_buf(b.ring, h.data(), b.n_ring*sizeof(uint16_t));
    for (size_t i = 0; i < b.n_pkv; ++i) {
        h[i] = f2h_bits(rng_uniform(-1.0f, 1.0f));
    }
    to_buf(b.pkv, h.data(), b.n_pkv*sizeof(uint16_t));
    to_buf(b.pkv0, h.data(), b.n_pkv*sizeof(uint16_t));

    std::vector<uint8_t> s(std::max(b.n_sk, b.n_sv));
    for (size_t i = 0; i < b.n_sk; ++i) {
        s[i] = (uint8_t) rng_u64();
    }
    for (size_t g = 0; g < b.n_sk/c.kgb; ++g) { // every (head, group) of sk
        uint8_t * kg = s.data() + g*c.kgb;
        if (cfg.kmix) {
            // the width table (2 bits per channel, width - kb + 1): D/4 channels at kb + 1 bits, D/4 at kb - 1, the
            // rest at kb, shuffled; then the blocks at their offsets take exactly D*KB bytes (KB: a kb-bit block)
            const int kb = (cfg.KB - 4)*8/G;
            std::vector<int> w(D, kb);
            std::fill(w.begin(), w.begin() + D/4, kb + 1);
            std::fill(w.begin() + D/4, w.begin() + D/2, kb - 1);
            for (int i = D - 1; i > 0; --i) {
                std::swap(w[i], w[(int) (rng_u64() % (uint64_t) (i + 1))]);
            }
            uint8_t * tbl = kg + (size_t) D*cfg.KB;
            memset(tbl, 0, D/4);
            size_t off = 0;
            for (int ch = 0; ch < D; ++ch) {
                tbl[ch/4] |= (uint8_t) ((w[ch] - kb + 1) << (2*(ch % 4)));
                put_u16(kg + off, f2h_bits(rng_uniform(0.02f, 0.3f)));
                put_u16(kg + off + 2, f2h_bits(rng_uniform(-0.6f, -0.05f)));
                off += 4 + (size_t) G*w[ch]/8;
            }
            OTT_ASSERT(off == (size_t) D*cfg.KB);
        } else {
            for (int ch = 0; ch < D; ++ch) {
                put_u16(kg + (size_t) ch*cfg.KB, f2h_bits(rng_uniform(0.02f, 0.3f)));
                put_u16(kg + (size_t) ch*cfg.KB + 2, f2h_bits(rng_uniform(-0.6f, -0.05f)));
            }
        }
    }
    to_buf(b.sk, s.data(), b.n_sk);
    for (size_t i = 0; i < b.n_sv; ++i) {
        s[i] = (uint8_t) rng_u64();
    }
    for (size_t i = 0; i < b.n_sv/cfg.VB; ++i) { // every V block: scale (sign bit: rotated, 15 of 16), min
        uint8_t * blk = s.data() + i*cfg.VB;
        const uint16_t rot = (rng_u64() % 16) != 0 ? 0x8000u : 0u;
        put_u16(blk, (uint16_t) (f2h_bits(rng_uniform(0.02f, 0.3f)) | rot));
        if (!cfg.vsym) {
            put_u16(blk + 2, f2h_bits(rng_uniform(-0.5f, 0.0f)));
        }
    }
    to_buf(b.sv, s.data(), b.n_sv);

    // pool: outlier_num members and half the aux capacity (a sealing event moves at most outlier_num rows to aux,
    // so the competition runs), positions distinct and sorted within each list, inside the sealed groups
    const int32_t n_pool = cfg.O, n_aux = cfg.aux/2, n_sealed_pos = c.n_sealed*G;
    OTT_ASSERT(n_pool + n_aux <= S && n_pool + n_aux <= n_sealed_pos && n_aux + cfg.O <= cfg.aux);
    std::vector<int32_t> m((size_t) (2*S + 3)*H, 0);
    for (int32_t hh = 0; hh < H; ++hh) {
        int32_t * row = m.data() + (size_t) hh*(2*S + 3);
        std::vector<int32_t> pos;
        while ((int32_t) pos.size() < n_pool + n_aux) {
            const int32_t p = (int32_t) (rng_u64() % (uint64_t) n_sealed_pos);
            if (std::find(pos.begin(), pos.end(), p) == pos.end()) {
                pos.push_back(p);
            }
        }
        std::sort(pos.begin(), pos.begin() + n_pool);
        std::sort(pos.begin() + n_pool, pos.end());
        for (int32_t i = 0; i < n_pool + n_aux; ++i) {
            const int32_t slot = i < n_pool ? i : cfg.O + (i - n_pool);
            // scores: sum over D of |K|, uniform [-1, 1) keys average D/2; a group's lowest of G sits near 0.4 D
            const float sc = rng_uniform(0.38f, 0.45f)*(float) D;
            row[2*slot] = pos[i];
            memcpy(&row[2*slot + 1], &sc, sizeof(sc));
        }
        row[2*S] = n_pool;
        row[2*S + 1] = n_aux;
        row[2*S + 2] = 1; // tracing
    }
    to_buf(b.pmeta, m.data(), b.n_pmeta*sizeof(int32_t));
    to_buf(b.pmeta0, m.data(), b.n_pmeta*sizeof(int32_t));
    const int32_t zero = 0;
    to_buf(b.flags, &zero, sizeof(zero));
}


// a case's buffers, sized as the kernels index them for its n_tok tokens; the partials for n_slices + 1 states
static ott_bench_bufs alloc_bufs(const ott_bench_case & c, int32_t n_slices) {
    const int32_t D = c.shape->D, H = c.shape->H, n_head = c.shape->n_head, gq = n_head/H;
    ott_bench_bufs b = {};
    b.n_q = (size_t) D*n_head*c.n_tok;
    b.n_kv = (size_t) D*H*c.n_tok;
    b.n_ring = (size_t) D*H*c.T*2;
    b.n_sk = c.kgb*c.NG*H;
    b.n_sv = c.vgb*c.NG*H;
    b.n_pkv = (size_t) D*c.S*2*H;
    b.n_pmeta = (size_t) (2*c.S + 3)*H;
    b.n_part = (size_t) (D + 2)*gq*c.n_tok*H*(n_slices + 1);
    b.n_out = (size_t) D*n_head*c.n_tok;
    b.n_scratch = (size_t) 2*c.cfg->G*D*H;
    b.q = buf_alloc<float>(b.n_q); b.k = buf_alloc<float>(b.n_kv); b.v = buf_alloc<float>(b.n_kv);
    b.part = buf_alloc<float>(b.n_part); b.out = buf_alloc<float>(b.n_out);
    b.ring = buf_alloc<uint16_t>(b.n_ring); b.pkv = buf_alloc<uint16_t>(b.n_pkv); b.pkv0 = buf_alloc<uint16_t>(b.n_pkv);
    b.scratch = buf_alloc<uint16_t>(b.n_scratch);
    b.sk = buf_alloc<uint8_t>(b.n_sk); b.sv = buf_alloc<uint8_t>(b.n_sv);
    b.pmeta = buf_alloc<int32_t>(b.n_pmeta); b.pmeta0 = buf_alloc<int32_t>(b.n_pmeta);
    b.plan = buf_alloc<int32_t>(4); b.flags = buf_alloc<int32_t>(1);
    return b;
}

static void free_bufs(ott_bench_bufs & b) {
    for (void * p : { (void *) b.q, (void *) b.k, (void *) b.v, (void *) b.part, (void *) b.out, (void *) b.ring,
                      (void *) b.pkv, (void *) b.pkv0, (void *) b.scratch, (void *) b.sk, (void *) b.sv,
                      (void *) b.pmeta, (void *) b.pmeta0, (void *) b.plan, (void *) b.flags }) {
        buf_free(p);
    }
    b = {};
}

static ott_cu_args make_args(const ott_bench_case & c, const ott_bench_bufs & b) {
    ott_cu_args a = {};
    a.D = c.shape->D; a.H = c.shape->H; a.n_head = c.shape->n_head;
    a.T = c.T; a.S = c.S; a.NG = c.NG; a.NS = c.NS;
    a.ns = 1; a.n_tok = c.n_tok; a.n_stream = 1;
    a.outlier_num = c.cfg->O; a.aux_cap = c.cfg->aux;
    a.scale = 1.0f/sqrtf((float) c.shape->D);
    a.v_rotate = 1;
    a.q = b.q; a.k = b.k; a.v = b.v; a.ring = b.ring; a.sk = b.sk; a.sv = b.sv; a.pkv = b.pkv; a.pmeta = b.pmeta;
    a.plan = b.plan; a.flags = b.flags; a.part = b.part; a.out = b.out; a.scratch = b.scratch;
    return a;
}

// ---- timing
struct ott_bench_env {
    cudaStream_t stream;
    cudaEvent_t e0, e1;
    int n_sm;
    void * flush;        // written between "cold" launches: twice the L2, so the next launch reads from HBM
    size_t flush_bytes;
};

static const int N_WARM = 20, N_BATCH = 5, N_PER_BATCH = 40, N_COLD = 10, N_SEAL_EVENTS = 10;

static float elapsed_us(const ott_bench_env & env) {
    float ms = 0.0f;
    OTT_CHECK(cudaEventSynchronize(env.e1));
    OTT_CHECK(cudaEventElapsedTime(&ms, env.e0, env.e1));
    return 1000.0f*ms;
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size()/2] : 0.5f*(v[v.size()/2 - 1] + v[v.size()/2]);
}

struct ott_bench_time {
    // us per launch: back to back in a CUDA graph (median of the batches, best batch), back to back from the
    // stream (median), alone after an L2 flush (median)
    float med, min, stream, cold;
};

// Back-to-back launches, N_PER_BATCH per batch: captured in a CUDA graph, as ggml-cuda replays a decode step (no
// host launch cost between them), and launched from the stream (GGML_CUDA_DISABLE_GRAPHS=1: a kernel shorter than
// the launch rate shows the launch rate). Both with the L2 warm: one layer's state is read again and again, as a
// decode step's layers would not; `cold` is the other end, each launch alone after the L2 was overwritten.
// us per launch of `reps` launches captured in one CUDA graph, replayed N_BATCH times (after one replay that uploads it)
template <typename F> static std::vector<float> graph_batches(const ott_bench_env & env, F launch, int reps) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    OTT_CHECK(cudaStreamBeginCapture(env.stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < reps; ++i) {
        launch(env.stream);
    }
    OTT_CHECK(cudaStreamEndCapture(env.stream, &graph));
    OTT_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    OTT_CHECK(cudaGraphLaunch(exec, env.stream)); // uploads the graph
    std::vector<float> per;
    for (int bt = 0; bt < N_BATCH; ++bt) {
        OTT_CHECK(cudaEventRecord(env.e0, env.stream));
        OTT_CHECK(cudaGraphLaunch(exec, env.stream));
        OTT_CHECK(cudaEventRecord(env.e1, env.stream));
        per.push_back(elapsed_us(env)/reps);
    }
    OTT_CHECK(cudaGraphExecDestroy(exec));
    OTT_CHECK(cudaGraphDestroy(graph));
    return per;
}

static ott_bench_time time_launches(const ott_bench_env & env, ott_bench_launcher fn, const ott_cu_args * a) {
    for (int i = 0; i < N_WARM; ++i) {
        fn(a, env.stream);
    }
    OTT_CHECK(cudaGetLastError());
    OTT_CHECK(cudaStreamSynchronize(env.stream));
    const std::vector<float> per = graph_batches(env, [&](cudaStream_t st) { fn(a, st); }, N_PER_BATCH);
    std::vector<float> str;
    for (int bt = 0; bt < N_BATCH; ++bt) {
        OTT_CHECK(cudaEventRecord(env.e0, env.stream));
        for (int i = 0; i < N_PER_BATCH; ++i) {
            fn(a, env.stream);
        }
        OTT_CHECK(cudaEventRecord(env.e1, env.stream));
        str.push_back(elapsed_us(env)/N_PER_BATCH);
    }
    OTT_CHECK(cudaGetLastError());
    std::vector<float> cold;
    for (int i = 0; i < N_COLD; ++i) {
        OTT_CHECK(cudaMemsetAsync(env.flush, i, env.flush_bytes, env.stream));
        OTT_CHECK(cudaEventRecord(env.e0, env.stream));
        fn(a, env.stream);
        OTT_CHECK(cudaEventRecord(env.e1, env.stream));
        cold.push_back(elapsed_us(env));
    }
    OTT_CHECK(cudaGetLastError());
    return { median(per), *std::min_element(per.begin(), per.end()), median(str), median(cold) };
}

static void print_row(const ott_bench_case & c, int kernel, int occ, int n_sm, const ott_bench_time & t) {
    // waves: how many times the grid fills every SM at the kernel's occupancy (below 1: SMs idle)
    const int64_t grid = c.grid[kernel];
    const double bytes = c.bytes[kernel], waves = (double) grid/((double) n_sm*std::max(occ, 1));
    char str[16] = "-", cold[16] = "-"; // a sealing event is timed alone only
    if (!std::isnan(t.stream)) {
        snprintf(str, sizeof(str), "%.1f", t.stream);
        snprintf(cold, sizeof(cold), "%.1f", t.cold);
    }
    printf("%-8s %-8s %6d %-16s %6" PRId64 " %6.2f %9.1f %9.1f %9s %9s %10.0f %8.1f\n", c.cfg->name, c.shape->name,
           c.depth, kernel_names[kernel], grid, waves, t.med, t.min, str, cold, bytes, bytes/(1e3*t.med));
}

static bool all_finite(const float * x, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(x[i])) {
            return false;
        }
    }
    return true;
}

static int run_case(const ott_bench_env & env, const ott_bench_case & c, const int occ[N_KERNELS]) {
    const ott_bench_cfg & cfg = *c.cfg;
    const int32_t D = c.shape->D, H = c.shape->H, n_head = c.shape->n_head, G = cfg.G;
    OTT_ASSERT(n_head % H == 0 && D % cfg.Gv == 0 && D <= 512);
    ott_bench_bufs b = alloc_bufs(c, c.NS);
    fill_state(c, b);
    const ott_cu_args a = make_args(c, b);

    const int32_t decode[4] = { 0, c.depth, c.n_sealed, c.n_sealed_after };
    OTT_ASSERT(c.n_sealed_after == c.n_sealed); // a decode step that seals nothing
    to_buf(b.plan, decode, sizeof(decode));
    if (emu) {
        cfg.epart(&a, nullptr);
        cfg.emerge(&a, nullptr);
    } else {
        print_row(c, R_PART, occ[K_PART], env.n_sm, time_launches(env, cfg.part, &a));
        const int32_t sealed_only[4] = { 0, c.n_sealed*G, c.n_sealed, c.n_sealed };
        to_buf(b.plan, sealed_only, sizeof(sealed_only));
        print_row(c, R_PART_SEALED, occ[K_PART], env.n_sm, time_launches(env, cfg.part, &a));
        const int32_t tail_only[4] = { 0, c.depth - c.n_sealed*G, 0, 0 };
        to_buf(b.plan, tail_only, sizeof(tail_only));
        print_row(c, R_PART_TAIL, occ[K_PART], env.n_sm, time_launches(env, cfg.part, &a));
        to_buf(b.plan, decode, sizeof(decode));
        cfg.part(&a, env.stream); // the partials of the decode plan again, for the merge below
        print_row(c, R_MERGE, occ[K_MERGE], env.n_sm, time_launches(env, cfg.merge, &a));
    }
    // garbage check: the merged output of the state above is finite and not all zero
    std::vector<float> out(b.n_out);
    from_buf(out.data(), b.out, b.n_out*sizeof(float));
    bool nonzero = false;
    for (float x : out) {
        nonzero = nonzero || x != 0.0f;
    }
    if (!all_finite(out.data(), out.size()) || !nonzero) {
        fprintf(stderr, "ott-bench: %s %s %d: attention output is %s\n", cfg.name, c.shape->name, c.depth,
                nonzero ? "not finite" : "all zero");
        return 1;
    }
    if (emu) {
        cfg.eseal(&a, nullptr);
    } else {
        print_row(c, R_SEAL, occ[K_SEAL], env.n_sm, time_launches(env, cfg.seal, &a));
    }
    // the merge and the seal in one launch: the same output, bit for bit (the merge's body is unchanged)
    std::vector<float> out_fused(b.n_out);
    from_buf(out_fused.data(), b.out, b.n_out*sizeof(float)); // the merge's output, as the seal left it
    const std::vector<float> nans(b.n_out, NAN);
    to_buf(b.out, nans.data(), b.n_out*sizeof(float));
    if (emu) {
        cfg.efused(&a, nullptr);
    } else {
        print_row(c, R_FUSED, occ[K_FUSED], env.n_sm, time_launches(env, cfg.fused, &a));
    }
    from_buf(out.data(), b.out, b.n_out*sizeof(float));
    if (memcmp(out.data(), out_fused.data(), b.n_out*sizeof(float)) != 0) {
        fprintf(stderr, "ott-bench: %s %s %d: the fused launch's attention output differs from the merge's\n",
                cfg.name, c.shape->name, c.depth);
        return 1;
    }

    // one sealing event per repeat: the plan of the token that seals group seal_from, the pool reset before each
    // launch (the competition moves rows; the group's codes and the ring slot written are rewritten identically);
    // by the seal alone, then by the fused launch
    const int32_t event[4] = { 0, c.seal_pos, c.seal_from, c.seal_to };
    to_buf(b.plan, event, sizeof(event));
    const size_t kg0 = (size_t) c.seal_from*c.kgb; // head 0's K bytes of the group that seals
    std::vector<uint8_t> kg_before(c.kgb), kg_after(c.kgb), kg_sealed;
    from_buf(kg_before.data(), b.sk + kg0, c.kgb);
    std::vector<int32_t> m(b.n_pmeta);
    for (const int row : { R_EVENT, R_FUSED_EVENT }) {
        const bool fused = row == R_FUSED_EVENT;
        std::vector<float> ev;
        for (int i = 0; i < (emu ? 1 : 1 + N_SEAL_EVENTS); ++i) { // on the GPU the first one warms up
            if (emu) {
                memcpy(b.pmeta, b.pmeta0, b.n_pmeta*sizeof(int32_t));
                memcpy(b.pkv, b.pkv0, b.n_pkv*sizeof(uint16_t));
                (fused ? cfg.efused : cfg.eseal)(&a, nullptr);
                continue;
            }
            OTT_CHECK(cudaMemcpyAsync(b.pmeta, b.pmeta0, b.n_pmeta*sizeof(int32_t), cudaMemcpyDeviceToDevice, env.stream));
            OTT_CHECK(cudaMemcpyAsync(b.pkv, b.pkv0, b.n_pkv*sizeof(uint16_t), cudaMemcpyDeviceToDevice, env.stream));
            OTT_CHECK(cudaEventRecord(env.e0, env.stream));
            (fused ? cfg.fused : cfg.seal)(&a, env.stream);
            OTT_CHECK(cudaEventRecord(env.e1, env.stream));
            OTT_CHECK(cudaGetLastError());
            const float us = elapsed_us(env);
            if (i > 0) {
                ev.push_back(us);
            }
        }
        // it sealed with a competition: the pool is full again, losers went to aux, tracing still on
        from_buf(m.data(), b.pmeta, b.n_pmeta*sizeof(int32_t));
        for (int32_t hh = 0; hh < H; ++hh) {
            const int32_t * r = m.data() + (size_t) hh*(2*c.S + 3);
            const int32_t n_aux = r[2*c.S + 1];
            if (r[2*c.S] != cfg.O || n_aux < cfg.aux/2 || n_aux > cfg.aux/2 + cfg.O || r[2*c.S + 2] != 1) {
                fprintf(stderr, "ott-bench: %s %s %d: the %s left n_pool %d, n_aux %d, tracing %d (head %d)\n",
                        cfg.name, c.shape->name, c.depth, kernel_names[row], r[2*c.S], r[2*c.S + 1], r[2*c.S + 2], hh);
                return 1;
            }
        }
        // and quantized the group (its bytes were random), to the same bytes both times
        from_buf(kg_after.data(), b.sk + kg0, c.kgb);
        if (kg_after == kg_before || (fused && kg_after != kg_sealed)) {
            fprintf(stderr, "ott-bench: %s %s %d: the %s left group %d %s\n", cfg.name, c.shape->name, c.depth,
                    kernel_names[row], c.seal_from, kg_after == kg_before ? "as it was" : "other than the seal did");
            return 1;
        }
        kg_sealed = kg_after;
        int32_t flag = 0;
        from_buf(&flag, b.flags, sizeof(flag));
        OTT_ASSERT(flag == 0); // the K/V were finite
        if (!emu) {
            const ott_bench_time te = { median(ev), *std::min_element(ev.begin(), ev.end()), NAN, NAN };
            print_row(c, row, occ[kernel_res[row]], env.n_sm, te);
        }
    }
    if (emu) {
        printf("%-8s %-8s %6d emulated: attention output finite, the fused launch's the same; sealing event with a "
               "competition (n_pool %d, n_aux %d of head 0), alone and fused\n", cfg.name, c.shape->name, c.depth,
               m[2*c.S], m[2*c.S + 1]);
    }

    free_bufs(b);
    return 0;
}

static bool pick(const char * arg, const char * name) {
    return arg == nullptr || strcmp(arg, "all") == 0 || strcmp(arg, name) == 0;
}

static void print_case(const ott_bench_case & c) {
    if (c.n_tok > 1) { // a prefill ubatch (--sweep)
        printf("# %s %s depth %d, a ubatch of %d tokens: n_ctx %d, NG %d, NS %d (SG %d), sealed %d groups (%d after), "
               "ring %d tokens\n", c.cfg->name, c.shape->name, c.depth, c.n_tok, c.n_ctx, c.NG, c.NS,
               (c.NG + c.NS - 1)/c.NS, c.n_sealed, c.n_sealed_after, c.depth - c.n_sealed*c.cfg->G);
        return;
    }
    printf("# %s %s depth %d: n_ctx %d, NG %d, NS %d (SG %d), sealed %d groups, ring %d tokens; sealing event at "
           "n_pos %d (group %d)\n", c.cfg->name, c.shape->name, c.depth, c.n_ctx, c.NG, c.NS, (c.NG + c.NS - 1)/c.NS,
           c.n_sealed, c.depth - c.n_sealed*c.cfg->G, c.seal_pos, c.seal_from);
}

// ---- --sweep (issue 47): the attention partials by other instances <CPL, RP, NW> (channels per lane, rows per
// pass, warps per block) and other slice counts NS, on the decode step and on a prefill ubatch, each checked
// against the launcher's output, then timed side by side: which instance the template should fix per D
// (gen/templates/ott_cuda_ops.j2 VEC), and what a prefill ubatch's partials cost at depth. The ott2 config only: its
// unit is built with OTT_SWEEP_k2mv2g128x64 (build-ott-bench.sh), which compiles the instances of SWEEP there.
// its emulation's entry (ott2-emu-k2mv2g128x64.cpp, built with the same definition)
extern "C" int ott2_emu_k2mv2g128x64_attn_part_variant(const ott_cu_args * a, void * stream, int cpl, int rp, int nw);
struct ott_bench_variant {
    int cpl, rp, nw;
};
static const ott_bench_variant variants[] = {
    { 2, 4, 16 }, { 2, 4, 8 }, { 2, 4, 4 }, { 2, 8, 8 }, { 2, 2, 16 }, // D 64: the launcher's <2, 4, 16> first
    { 4, 4, 8 }, { 4, 4, 4 }, { 4, 2, 8 }, { 4, 2, 4 }, { 4, 1, 16 },  // D 128: <4, 4, 8> first
};
// a prefill ubatch as the cache runs one: a run of a sequence never crosses a position R + kG (batch invariance,
// docs/design-ott2-cache.md "Batches"), so a prompt's ubatches at depth are G tokens from such a boundary, whatever
// n_ubatch; the emulation takes a short one (same code, seconds)
static const int32_t NP_EMU = 8;
// largest |variant - launcher| / max |launcher| over the merged output accepted: a variant sums a row's items in
// another order (NW) or merges other slices (NS), so fp32 rounding apart; RP alone changes no bit
static const double SWEEP_TOL = 1e-4;

// us per launch, quickly: one launch sizes the batch (about 5 ms of launches, 3 to 40), captured in a CUDA graph
// and replayed 5 times (median, best), so that a sweep of prefill launches of tens of ms stays within seconds
template <typename F> static ott_bench_time time_quick(const ott_bench_env & env, F launch) {
    launch(env.stream);
    OTT_CHECK(cudaGetLastError());
    OTT_CHECK(cudaEventRecord(env.e0, env.stream));
    launch(env.stream);
    OTT_CHECK(cudaEventRecord(env.e1, env.stream));
    const float t1 = elapsed_us(env);
    const int reps = std::max(3, std::min(40, (int) (5000.0f/std::max(t1, 1.0f))));
    const std::vector<float> per = graph_batches(env, launch, reps);
    return { median(per), *std::min_element(per.begin(), per.end()), NAN, NAN };
}

static int run_sweep(const ott_bench_env & env, const ott_bench_shape * sh, int32_t depth) {
    const ott_bench_cfg & cfg = cfgs[0]; // ott2: k2mv2g128x64
    const auto variant = emu ? ott2_emu_k2mv2g128x64_attn_part_variant : ott2_cuda_k2mv2g128x64_attn_part_variant;
    const int32_t D = sh->D, H = sh->H, n_head = sh->n_head, gq = n_head/H;
    for (const int32_t n_tok : { 1, emu ? NP_EMU : cfg.G }) {
        // the prefill ubatch starts at the last boundary R + kG at or below the depth (k groups sealed, R ring tokens)
        const int32_t at = n_tok == 1 || depth < cfg.R ? depth : cfg.R + (depth - cfg.R)/cfg.G*cfg.G;
        const ott_bench_case c = make_case(&cfg, sh, depth, n_tok, at);
        print_case(c);
        ott_bench_bufs b = alloc_bufs(c, OTT_MAX_SLICES_BENCH);
        fill_state(c, b);
        const ott_cu_args a = make_args(c, b);
        const int32_t plan[4] = { 0, c.depth, c.n_sealed, c.n_sealed_after };
        to_buf(b.plan, plan, sizeof(plan));
        // the launcher's partials and merge: the output every variant must give
        buf_sync();
        (emu ? cfg.epart : cfg.part)(&a, env.stream);
        (emu ? cfg.emerge : cfg.merge)(&a, env.stream);
        buf_sync();
        std::vector<float> ref(b.n_out), out(b.n_out);
        from_buf(ref.data(), b.out, b.n_out*sizeof(float));
        double ref_max = 0.0;
        for (float x : ref) {
            ref_max = std::max(ref_max, (double) std::fabs(x));
        }
        if (!all_finite(ref.data(), ref.size()) || ref_max == 0.0) {
            fprintf(stderr, "ott-bench: sweep %s %d n_tok %d: the launcher's output is not finite or all zero\n",
                    sh->name, depth, n_tok);
            return 1;
        }
        // slice counts: the cache's, half and twice it (at most OTT_MAX_SLICES_BENCH)
        std::vector<int32_t> nss = { c.NS };
        for (const int32_t ns : { c.NS/2, 2*c.NS }) {
            if (ns >= 1 && ns <= OTT_MAX_SLICES_BENCH && ns != c.NS) {
                nss.push_back(ns);
            }
        }
        const std::vector<float> nans(b.n_out, NAN);
        for (const int32_t ns : nss) {
            for (const ott_bench_variant & v : variants) {
                ott_cu_args av = a;
                av.NS = ns;
                // the output NaN, every partial state 3.4e38 (L > 0: a state the variant leaves unwritten is
                // merged, and dominates)
                to_buf(b.out, nans.data(), b.n_out*sizeof(float));
                buf_fill(b.part, 0x7f, b.n_part*sizeof(float));
                buf_sync();
                if (!variant(&av, env.stream, v.cpl, v.rp, v.nw)) {
                    continue; // not this D's
                }
                (emu ? cfg.emerge : cfg.merge)(&av, env.stream);
                if (!emu) {
                    OTT_CHECK(cudaGetLastError());
                }
                buf_sync();
                from_buf(out.data(), b.out, b.n_out*sizeof(float));
                double err = 0.0;
                for (size_t i = 0; i < out.size(); ++i) {
                    const double d = std::fabs((double) out[i] - (double) ref[i]);
                    err = std::isfinite(out[i]) ? std::max(err, d) : INFINITY;
                }
                err /= ref_max;
                const bool launcher = ns == c.NS && &v == &variants[D <= 64 ? 0 : 5];
                const int64_t grid = (int64_t) H*(ns + gq)*((n_tok + OTT_TC - 1)/OTT_TC);
                char name[48];
                snprintf(name, sizeof(name), "<%d,%d,%d>%s", v.cpl, v.rp, v.nw, launcher ? "*" : "");
                if (emu) {
                    printf("sweep %-8s %6d %5d %4d %-12s %7" PRId64 " %9s %9s %9.2e\n", sh->name, depth, n_tok, ns,
                           name, grid, "-", "-", err);
                } else {
                    const ott_bench_time t = time_quick(env, [&](cudaStream_t st) {
                        variant(&av, st, v.cpl, v.rp, v.nw);
                    });
                    printf("sweep %-8s %6d %5d %4d %-12s %7" PRId64 " %9.1f %9.1f %9.2e\n", sh->name, depth, n_tok,
                           ns, name, grid, t.med, t.min, err);
                }
                if (!(err <= SWEEP_TOL)) {
                    fprintf(stderr, "ott-bench: sweep %s %d n_tok %d NS %d <%d,%d,%d>: output differs from the "
                            "launcher's by %.3g (relative)\n", sh->name, depth, n_tok, ns, v.cpl, v.rp, v.nw, err);
                    return 1;
                }
                fflush(stdout);
            }
        }
        free_bufs(b);
    }
    return 0;
}

static const char * const usage =
    "usage: ott-bench [--plan|--emu] [--sweep] [smol|llama8b|all] [4096|32768|all] [ott2|ott2u|quality|all]\n"
    "  --plan: the cases' sizes, grids and bytes only; --emu: the cases' state and checks run through the kernels'\n"
    "  CPU emulation (no timing); neither needs a GPU. --sweep: the attention partials' instances and slice counts\n"
    "  (ott2 only), on the decode step and a prefill ubatch, checked against the launcher's output and timed\n";

int main(int argc, char ** argv) {
    bool plan_only = false, sweep = false;
    int a0 = 1;
    for (; a0 < argc && strncmp(argv[a0], "--", 2) == 0; ++a0) {
        if (strcmp(argv[a0], "--plan") == 0) {
            plan_only = true;
        } else if (strcmp(argv[a0], "--emu") == 0) {
            emu = true;
        } else if (strcmp(argv[a0], "--sweep") == 0) {
            sweep = true;
        } else {
            fputs(usage, stderr);
            return 2;
        }
    }
    const char * a_shape = argc > a0     ? argv[a0]     : nullptr;
    const char * a_depth = argc > a0 + 1 ? argv[a0 + 1] : nullptr;
    const char * a_cfg   = argc > a0 + 2 ? argv[a0 + 2] : nullptr;
    std::vector<ott_bench_case> cases;
    bool any_shape = false, any_depth = false, any_cfg = false;
    for (const auto & cfg : cfgs) {
        any_cfg = any_cfg || pick(a_cfg, cfg.name);
        for (const auto & sh : shapes) {
            any_shape = any_shape || pick(a_shape, sh.name);
            for (int32_t d : depths) {
                any_depth = any_depth || pick(a_depth, std::to_string(d).c_str());
                if (pick(a_cfg, cfg.name) && pick(a_shape, sh.name) && pick(a_depth, std::to_string(d).c_str())) {
                    cases.push_back(make_case(&cfg, &sh, d));
                }
            }
        }
    }
    if (argc > a0 + 3 || !any_shape || !any_depth || !any_cfg || (plan_only && (emu || sweep)) ||
        (sweep && !pick(a_cfg, "ott2"))) {
        fputs(usage, stderr);
        return 2;
    }
    // the sweep's cases: ott2 at each shape and depth picked
    std::vector<std::pair<const ott_bench_shape *, int32_t>> sweeps;
    for (const auto & sh : shapes) {
        for (int32_t d : depths) {
            if (sweep && pick(a_shape, sh.name) && pick(a_depth, std::to_string(d).c_str())) {
                sweeps.emplace_back(&sh, d);
            }
        }
    }
    static const char * const sweep_head =
        "\nsweep (ott2; <CPL,RP,NW>: channels per lane, rows per pass, warps per block; * the launcher's; err: max "
        "|out - launcher's| / max |launcher's|)\n"
        "sweep shape     depth n_tok   NS instance       grid    us_med    us_min       err\n";
    if (plan_only) {
        printf("%-8s %-8s %6s %-16s %6s %10s\n", "config", "shape", "depth", "kernel", "grid", "bytes");
        for (const auto & c : cases) {
            print_case(c);
            for (int k = 0; k < N_ROWS; ++k) {
                printf("%-8s %-8s %6d %-16s %6" PRId64 " %10.0f\n", c.cfg->name, c.shape->name, c.depth,
                       kernel_names[k], c.grid[k], c.bytes[k]);
            }
        }
        return 0;
    }
    if (emu) {
        const ott_bench_env env = {};
        const int occ[N_KERNELS] = {};
        for (const auto & c : cases) {
            if (sweep) {
                break; // --emu --sweep: the sweep alone
            }
            print_case(c);
            if (run_case(env, c, occ) != 0) {
                return 1;
            }
            fflush(stdout);
        }
        if (sweep) {
            fputs(sweep_head, stdout);
        }
        for (const auto & [sh, d] : sweeps) {
            if (run_sweep(env, sh, d) != 0) {
                return 1;
            }
        }
        printf("ott-bench: ok (emulated)\n");
        return 0;
    }

    int dev = 0;
    OTT_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    OTT_CHECK(cudaGetDeviceProperties(&prop, dev));
    ott_bench_env env = {};
    env.n_sm = prop.multiProcessorCount;
    env.flush_bytes = 2*(size_t) std::max(prop.l2CacheSize, 1 << 20);
    OTT_CHECK(cudaMalloc(&env.flush, env.flush_bytes));
    OTT_CHECK(cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking));
    OTT_CHECK(cudaEventCreate(&env.e0));
    OTT_CHECK(cudaEventCreate(&env.e1));
    printf("ott-bench: %s, sm_%d%d, %d SMs, L2 %d MB; per kernel %d batches of %d launches in a CUDA graph and as "
           "many from the stream, %d alone after an L2 flush; %d sealing events\n", prop.name, prop.major, prop.minor,
           env.n_sm, prop.l2CacheSize >> 20, N_BATCH, N_PER_BATCH, N_COLD, N_SEAL_EVENTS);

    // resources per kernel: registers, local memory (stack and spills), static shared memory, blocks per SM;
    // attn_part per shape (its kernel depends on D: attn_part_vec<CPL>, CPL = channels per lane)
    const size_t n_cfg = sizeof(cfgs)/sizeof(cfgs[0]), n_shape = sizeof(shapes)/sizeof(shapes[0]);
    int occ[n_cfg][n_shape][N_KERNELS];
    printf("\n%-8s %-44s %5s %7s %7s %9s %8s\n", "config", "kernel", "regs", "local_B", "smem_B", "blocks/SM",
           "warps/SM");
    for (size_t ci = 0; ci < n_cfg; ++ci) {
        const ott_bench_cfg & cfg = cfgs[ci];
        for (size_t si = 0; si < n_shape; ++si) {
            const int32_t D = shapes[si].D;
            int32_t part_threads = 0;
            const char * part_targs = "";
            const void * kpart = cfg.kpart(D, &part_threads, &part_targs);
            const void * ks[N_KERNELS] = { kpart, cfg.kmerge, cfg.kseal, cfg.kfused };
            for (int k = 0; k < N_KERNELS; ++k) {
                const int nt = k == 0 ? part_threads : OTT_NT;
                cudaFuncAttributes fa;
                OTT_CHECK(cudaFuncGetAttributes(&fa, ks[k]));
                OTT_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ[ci][si][k], ks[k], nt, 0));
                if (pick(a_cfg, cfg.name) && (k == 0 || si == 0)) {
                    // as ncu names it
                    std::string fn = std::string("ott2_cuda_") + cfg.tag + "_" + kernel_fn[k];
                    if (k == 0) {
                        fn += std::string("_vec") + part_targs;
                    }
                    printf("%-8s %-44s %5d %7zu %7zu %9d %8d\n", cfg.name, fn.c_str(), fa.numRegs,
                           fa.localSizeBytes, fa.sharedSizeBytes, occ[ci][si][k], occ[ci][si][k]*nt/32);
                }
            }
        }
    }

    printf("\n%-8s %-8s %6s %-16s %6s %6s %9s %9s %9s %9s %10s %8s\n", "config", "shape", "depth", "kernel", "grid",
           "waves", "us_med", "us_min", "us_stream", "us_cold", "bytes", "GB/s");
    for (const auto & c : cases) {
        if (sweep) {
            break; // --sweep: the sweep alone
        }
        print_case(c);
        if (run_case(env, c, occ[c.cfg - cfgs][c.shape - shapes]) != 0) {
            return 1;
        }
        fflush(stdout);
    }
    if (sweep) {
        // the instances' resources at sm_XY (registers, static shared memory, blocks per SM at their threads)
        printf("\n%-44s %5s %7s %7s %9s %8s\n", "sweep instance", "regs", "local_B", "smem_B", "blocks/SM", "warps/SM");
        for (const ott_bench_variant & v : variants) {
            const void * k = ott2_cuda_k2mv2g128x64_attn_part_variant_kernel(v.cpl, v.rp, v.nw);
            OTT_ASSERT(k != nullptr);
            cudaFuncAttributes fa;
            int blocks = 0;
            OTT_CHECK(cudaFuncGetAttributes(&fa, k));
            OTT_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, 32*v.nw, 0));
            char name[64];
            snprintf(name, sizeof(name), "ott2_cuda_k2mv2g128x64_attn_part_vec<%d,%d,%d>", v.cpl, v.rp, v.nw);
            printf("%-44s %5d %7zu %7zu %9d %8d\n", name, fa.numRegs, fa.localSizeBytes, fa.sharedSizeBytes, blocks,
                   blocks*v.nw);
        }
        fputs(sweep_head, stdout);
    }
    for (const auto & [sh, d] : sweeps) {
        if (run_sweep(env, sh, d) != 0) {
            return 1;
        }
    }
    OTT_CHECK(cudaDeviceSynchronize());
    printf("ott-bench: ok\n");
    return 0;
}
