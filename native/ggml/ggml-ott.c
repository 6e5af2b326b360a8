// ott-gguf: constructors of the ott2 cache's ops (ggml-ott.h)
#include "ggml-ott.h"
#include "ggml-impl.h"

#include <stdlib.h>
#include <string.h>

static void ott_check_state(const struct ggml_tensor * ring, const struct ggml_tensor * sk, const struct ggml_tensor * sv,
        const struct ggml_tensor * pkv, const struct ggml_tensor * pmeta, const struct ggml_tensor * plan,
        const struct ggml_ott_params * p) {
    GGML_ASSERT(ring->type == GGML_TYPE_F16 && ring->ne[0] == p->D && ring->ne[1] == p->H && ring->ne[2] == p->T &&
                ring->ne[3] == 2*p->n_stream);
    GGML_ASSERT(sk->type == GGML_TYPE_I8 && (ggml_ott_k_young(p) ? sk->ne[1] > p->NG : sk->ne[1] == p->NG) &&
                sk->ne[2] == p->H && sk->ne[3] == p->n_stream);
    GGML_ASSERT(sv->type == GGML_TYPE_I8 && (ggml_ott_v_young(p) ? sv->ne[1] > p->NG : sv->ne[1] == p->NG) &&
                sv->ne[2] == p->H && sv->ne[3] == p->n_stream);
    GGML_ASSERT(pkv->type == GGML_TYPE_F16 && pkv->ne[0] == p->D && pkv->ne[1] == p->S && pkv->ne[2] == 2 &&
                pkv->ne[3] == (int64_t) p->H*p->n_stream);
    GGML_ASSERT(pmeta->type == GGML_TYPE_I32 && pmeta->ne[0] == 2*p->S + 3 && pmeta->ne[1] == p->H &&
                pmeta->ne[2] == p->n_stream);
    GGML_ASSERT(plan->type == GGML_TYPE_I32 && plan->ne[0] == 4);
    GGML_ASSERT(ggml_is_contiguous(ring) && ggml_is_contiguous(sk) && ggml_is_contiguous(sv) &&
                ggml_is_contiguous(pkv) && ggml_is_contiguous(pmeta) && ggml_is_contiguous(plan));
    GGML_ASSERT(p->n_head % p->H == 0 && p->D % p->Gv == 0 && p->NS >= 1);
}

static void ott_check_kv(const struct ggml_tensor * k, const struct ggml_tensor * v, const struct ggml_tensor * plan,
        const struct ggml_ott_params * p) {
    GGML_ASSERT(k->type == GGML_TYPE_F32 && v->type == GGML_TYPE_F32 && ggml_is_contiguous(k) && ggml_is_contiguous(v));
    GGML_ASSERT(k->ne[0] == p->D && k->ne[1] == p->H && ggml_are_same_shape(k, v));
    GGML_ASSERT(k->ne[2] % plan->ne[1] == 0);
}

struct ggml_tensor * ggml_ott_attn_part(struct ggml_context * ctx, struct ggml_tensor * q,
        struct ggml_tensor * k, struct ggml_tensor * v, struct ggml_tensor * ring, struct ggml_tensor * sealed_k,
        struct ggml_tensor * sealed_v, struct ggml_tensor * pool_kv, struct ggml_tensor * pool_meta,
        struct ggml_tensor * plan, const struct ggml_ott_params * p) {
    ott_check_state(ring, sealed_k, sealed_v, pool_kv, pool_meta, plan, p);
    ott_check_kv(k, v, plan, p);
    GGML_ASSERT(q->type == GGML_TYPE_F32 && ggml_is_contiguous(q) && q->ne[0] == p->D && q->ne[1] == p->n_head &&
                q->ne[2] == k->ne[2]);
    const int64_t ns = plan->ne[1], n_tok = q->ne[2] / ns, gq = p->n_head / p->H;
    struct ggml_tensor * result = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, p->D + 2, gq*n_tok, p->H, ns*(p->NS + 1));
    ggml_set_op_params(result, p, sizeof(*p));
    result->op = GGML_OP_OTT_ATTN_PART;
    struct ggml_tensor * srcs[9] = { q, k, v, ring, sealed_k, sealed_v, pool_kv, pool_meta, plan };
    memcpy(result->src, srcs, sizeof(srcs));
    return result;
}

struct ggml_tensor * ggml_ott_attn(struct ggml_context * ctx, struct ggml_tensor * part, int64_t n_tok_all,
        struct ggml_tensor * flags, const struct ggml_ott_params * p) {
    GGML_ASSERT(part->type == GGML_TYPE_F32 && part->ne[0] == p->D + 2 && part->ne[2] == p->H);
    GGML_ASSERT(!flags || (flags->type == GGML_TYPE_I32 && flags->ne[0] == p->n_stream));
    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, p->D, p->n_head, n_tok_all);
    ggml_set_op_params(result, p, sizeof(*p));
    result->op = GGML_OP_OTT_ATTN;
    result->src[0] = part;
    result->src[1] = flags;
    return result;
}

struct ggml_tensor * ggml_ott_seal(struct ggml_context * ctx, struct ggml_tensor * after,
        struct ggml_tensor * k, struct ggml_tensor * v, struct ggml_tensor * ring, struct ggml_tensor * sealed_k,
        struct ggml_tensor * sealed_v, struct ggml_tensor * pool_kv, struct ggml_tensor * pool_meta,
        struct ggml_tensor * plan, struct ggml_tensor * flags, const struct ggml_ott_params * p) {
    ott_check_state(ring, sealed_k, sealed_v, pool_kv, pool_meta, plan, p);
    ott_check_kv(k, v, plan, p);
    GGML_ASSERT(flags->type == GGML_TYPE_I32 && flags->ne[0] == p->n_stream);
    struct ggml_tensor * result = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
    ggml_set_op_params(result, p, sizeof(*p));
    result->op = GGML_OP_OTT_SEAL;
    struct ggml_tensor * srcs[10] = { after, k, v, ring, sealed_k, sealed_v, pool_kv, pool_meta, plan, flags };
    memcpy(result->src, srcs, sizeof(srcs));
    return result;
}

// OTT_SLICE_GROUPS=<n> (a tuning knob for a GPU session, docs/cuda-harness.md "Tuning builds"; not for users): n
// groups per slice instead of OTT_SLICE_GROUPS, so that the model can be timed at the slice count `ott-bench --sweep`
// found fastest. Still a function of NG alone (batch invariance); it changes the order of the merge's sums.
static int32_t ott_slice_groups(void) {
    static int32_t gps = 0; // set once; every caller would set the same value
    if (gps == 0) {
        const char * s = getenv("OTT_SLICE_GROUPS");
        int32_t v = OTT_SLICE_GROUPS;
        if (s && *s) {
            char * end = NULL;
            const long x = strtol(s, &end, 10);
            if (*end != 0 || x < 1 || x > 1 << 20) {
                GGML_ABORT("ott: OTT_SLICE_GROUPS=%s: expected the sealed groups per slice, an integer >= 1", s);
            }
            v = (int32_t) x;
        }
        gps = v;
    }
    return gps;
}

int32_t ggml_ott_attn_slices(ggml_backend_buffer_t state_buf, int64_t n_tok, int32_t NG) {
    // one rule for every batch size and backend: slice k always holds groups [k*SG, (k + 1)*SG), SG = ceil(NG/NS),
    // so a query's partial states, and their merge, do not depend on how its batch was split
    (void) state_buf;
    (void) n_tok;
    const int32_t gps = ott_slice_groups();
    const int32_t ns = (NG + gps - 1)/gps;
    return ns < 1 ? 1 : ns > OTT_MAX_SLICES ? OTT_MAX_SLICES : ns;
}
