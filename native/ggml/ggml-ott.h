// ott-gguf: the ott2 KV cache's graph ops (GGML_OP_OTT_*), built into ggml-base; CPU implementations in
// ggml-cpu (ggml-cpu-ott.cpp), CUDA ones in ggml-cuda (ggml-cuda-ott.cu, kernels from gen/templates).
// Tensor layouts: gen/templates/ott_cuda_ops.j2.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// the op parameters (op_params, 16 x 4 bytes: GGML_MAX_OP_PARAMS)
struct ggml_ott_params {
    int32_t D, H, n_head, G, Gv, T, S, NG, n_stream, outlier_num, aux_cap, NS;
    float   scale;
    int32_t kbits, vbits; // code widths of K and V
    int32_t flags;        // GGML_OTT_V_ROTATE | GGML_OTT_K_MIX | GGML_OTT_V_SYM (the 16 slots are full: one for the switches)
};
// V is stored rotated (sealed partials are in the rotated basis until the merge)
#define GGML_OTT_V_ROTATE 1
// K widths per channel in each sealed group (k_mix: 3-bit keys, and 2-bit keys with k_mix 2): a head's K group is D*KB + D/4 bytes
#define GGML_OTT_K_MIX    2
// symmetric V blocks (v_sym, 2-bit values): one fp16 scale, no min (a V block is 2 bytes shorter)
#define GGML_OTT_V_SYM    4
// keys and values by age (llama_ott_config.k_young / v_young, docs/long-context.md): the keys (values) of the newest
// A sealed groups are also held at the next wider K (V) format (kbits + 1, mixed per channel with
// GGML_OTT_K_YOUNG_MIX; vbits + 1), group g in slot g % A of a ring that follows the NG group slots of sealed_k
// (sealed_v): that tensor's ne[1] > NG, its slots past NG hold the ring; attention reads those groups' keys (values)
// from there. A of the keys in bits 8..15 of flags, of the values in bits 16..23 (0: none). CPU only so far.
#define GGML_OTT_K_YOUNG_MIX   8
#define GGML_OTT_K_YOUNG_SHIFT 8
#define GGML_OTT_V_YOUNG_SHIFT 16
static inline int32_t ggml_ott_k_young(const struct ggml_ott_params * p) {
    return (p->flags >> GGML_OTT_K_YOUNG_SHIFT) & 255;
}
static inline int32_t ggml_ott_v_young(const struct ggml_ott_params * p) {
    return (p->flags >> GGML_OTT_V_YOUNG_SHIFT) & 255;
}

// attention partials: an online-softmax state (acc [D], M, L) per query row and unit
// -> F32 [D + 2, gq*n_tok, H, ns*(NS + 1)], ns = plan->ne[1], n_tok = q->ne[2] / ns
GGML_API struct ggml_tensor * ggml_ott_attn_part(struct ggml_context * ctx, struct ggml_tensor * q,
        struct ggml_tensor * k, struct ggml_tensor * v, struct ggml_tensor * ring, struct ggml_tensor * sealed_k,
        struct ggml_tensor * sealed_v, struct ggml_tensor * pool_kv, struct ggml_tensor * pool_meta,
        struct ggml_tensor * plan, const struct ggml_ott_params * p);

// merge of the partials -> F32 [D, n_head, ns*n_tok]. flags (optional): the layer's flags when ggml_ott_seal of the
// partials' own tensors follows this merge; a backend may then run that seal in the merge's launch (CUDA: one
// launch for both, and the OTT_SEAL node launches nothing); the others ignore it
GGML_API struct ggml_tensor * ggml_ott_attn(struct ggml_context * ctx, struct ggml_tensor * part, int64_t n_tok_all,
        struct ggml_tensor * flags, const struct ggml_ott_params * p);

// seal the groups the ubatch made eligible and keep its unsealed tokens in the ring (writes the cache's
// tensors in place); `after` orders it after the layer's attention; flags: I32 [n_stream], set to 1 on
// non-finite K/V. -> I32 [1] (no content)
GGML_API struct ggml_tensor * ggml_ott_seal(struct ggml_context * ctx, struct ggml_tensor * after,
        struct ggml_tensor * k, struct ggml_tensor * v, struct ggml_tensor * ring, struct ggml_tensor * sealed_k,
        struct ggml_tensor * sealed_v, struct ggml_tensor * pool_kv, struct ggml_tensor * pool_meta,
        struct ggml_tensor * plan, struct ggml_tensor * flags, const struct ggml_ott_params * p);

// slices of the sealed groups per (stream, KV head) that the attention op splits them into (its NS), for the
// state in `state_buf`, n_tok tokens per stream and NG groups: a function of NG only (batch invariance: decode and
// prefill merge the same partial states in the same order). Slice k holds groups [k*SG, (k + 1)*SG) with
// SG = ceil(NG/NS) (ggml_ott_slice_groups): flash-decoding over the sequence for every batch size.
#define OTT_SLICE_GROUPS 4  // groups per slice while NG/4 slices fit in OTT_MAX_SLICES
#define OTT_MAX_SLICES   32
GGML_API int32_t ggml_ott_attn_slices(ggml_backend_buffer_t state_buf, int64_t n_tok, int32_t NG);
static inline int32_t ggml_ott_slice_groups(int32_t NG, int32_t NS) {
    return (NG + NS - 1)/NS;
}

#ifdef __cplusplus
}
#endif
