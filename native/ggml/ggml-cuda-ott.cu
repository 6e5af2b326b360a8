// ott-gguf: the ott2 cache's ops on CUDA: tensors to kernel arguments (ggml-ott-args.h), then the generated
// kernels (ott2-cuda-<tag>.cu, from gen/templates/ott_cuda_ops.j2, a unit per head config).
#include "ggml-cuda-ott.cuh"
#include "ggml-ott-args.h"

static const ott2_cu_ops * ott_cu_ops_of(const ggml_tensor * op) {
    // the merge (GGML_OP_OTT_ATTN) has no state sources of its own: its partials' op has them
    const ggml_tensor * st = op->op == GGML_OP_OTT_ATTN ? op->src[0] : op;
    GGML_ASSERT(st && st->src[4]);
    const ggml_ott_params & p = *ggml_ott_get_params(op);
    const ott2_cu_ops * ops = ott2_cuda_find(p.kbits, p.vbits, (p.flags & GGML_OTT_K_MIX) != 0, (p.flags & GGML_OTT_V_SYM) != 0);
    // the kernels are generated for one (G, Gv) and every width pair; D up to 512 (4 channels per thread of 128);
    // the sealed K groups (src[4]) laid out as these kernels write them
    return ops && p.G == ops->G && p.Gv == ops->Gv && p.D <= 512 && p.D % p.Gv == 0 &&
        (size_t) st->src[4]->ne[0] == ott2_cu_kgroup_bytes(ops, p.D) ? ops : nullptr;
}

// the buffer is device memory of CUDA device `device` (-1: of any CUDA device)
static bool ott_cu_on_device(const ggml_tensor * t, int device) {
    if (!t->buffer) {
        return false;
    }
    for (int d = 0; d < ggml_backend_cuda_get_device_count(); ++d) {
        if ((device < 0 || d == device) && ggml_backend_buffer_get_type(t->buffer) == ggml_backend_cuda_buffer_type(d)) {
            return true;
        }
    }
    return false;
}

bool ggml_cuda_ott_supports_op(const ggml_tensor * op) {
    // a merge given its layer's flags (src[1]) may run the layer's seal (below), which writes the state in place:
    // only where the state lives, like the partials and the seal (without this, a state in host memory would have
    // the scheduler offload such a merge to the GPU for the flags, a weight, at 32 rows and more)
    if (op->op == GGML_OP_OTT_ATTN && op->src[1] && !ott_cu_on_device(op->src[0]->src[3], -1)) {
        return false;
    }
    // keys and values by age (k_young, v_young) have CPU kernels only: the cache refuses to offload such a state (llama-kv-cache-ott.cpp)
    if (op->op != GGML_OP_OTT_ATTN && (ggml_ott_k_young(ggml_ott_get_params(op)) != 0 ||
                                      ggml_ott_v_young(ggml_ott_get_params(op)) != 0)) {
        return false;
    }
    return ott_cu_ops_of(op) != nullptr;
}

// The layer's merge and seal in one launch (ott2_cu_ops.attn_merge_seal, docs/cuda-harness.md "The seal when
// nothing seals"): the seal then costs no launch of its own on the 127 of 128 decode steps that seal nothing. The
// merge does it when the graph gave it the layer's flags (src[1]: its OTT_SEAL follows, on the same tensors; see
// llama_ott_build_attn), the state lives on this device, and the launch fits one wave at the fused kernel's
// occupancy: its blocks hold the seal's registers (about 214, so 2 blocks of 128 threads per SM where the merge
// alone runs 9), which would stretch a prefill's merge of thousands of blocks over more waves than a launch costs.
// The OTT_SEAL node asks the same question and launches nothing when the answer is yes.
#define OTT_CU_FUSED_BLOCKS_PER_SM 2

static bool ott_cu_merge_seals(const ggml_backend_cuda_context & ctx, const ggml_tensor * merge) {
    const ggml_tensor * part = merge->src[0];
    const ggml_tensor * flags = merge->src[1];
    if (!flags || part->op != GGML_OP_OTT_ATTN_PART || !ott_cu_on_device(flags, ctx.device) ||
        !ott_cu_on_device(part->src[3], ctx.device)) {
        return false;
    }
    const ggml_ott_params & p = *ggml_ott_get_params(part);
    const int64_t ns = part->src[8]->ne[1], n_tok = part->src[1]->ne[2] / ns;
    const int64_t blocks = ns*n_tok*p.n_head + ns*p.H;
    return blocks <= (int64_t) OTT_CU_FUSED_BLOCKS_PER_SM*ggml_cuda_info().devices[ctx.device].nsm;
}

void ggml_cuda_op_ott_attn_part(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ott2_cu_ops * ops = ott_cu_ops_of(dst);
    GGML_ASSERT(ops);
    ott_cu_args a = ggml_ott_cu_args(dst);
    GGML_ASSERT((uintptr_t) a.ring % 16 == 0 && "ott: the fp16 tail reads ring rows 16 bytes at a time");
    a.part = (float *) dst->data;
    ggml_ott_cu_attn_part(ops, &a, ctx.stream()); // the launcher's instance, or OTT_CUDA_PART's (ggml-ott-args.h)
}

void ggml_cuda_op_ott_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * part = dst->src[0];
    GGML_ASSERT(part->op == GGML_OP_OTT_ATTN_PART);
    const ott2_cu_ops * ops = ott_cu_ops_of(part);
    GGML_ASSERT(ops);
    ott_cu_args a = ggml_ott_cu_args(part); // the merge reads `part`; the seal the partials' sources
    a.part = (float *) part->data;
    a.out = (float *) dst->data;
    if (!ott_cu_merge_seals(ctx, dst)) {
        ops->attn_merge(&a, ctx.stream());
        return;
    }
    a.flags = (int32_t *) dst->src[1]->data;
    ggml_cuda_pool_alloc<uint16_t> scratch(ctx.pool(), (size_t) 2*ops->G*a.D*a.ns*a.H); // as the seal's, below
    a.scratch = scratch.get();
    ops->attn_merge_seal(&a, ctx.stream());
}

void ggml_cuda_op_ott_seal(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ott2_cu_ops * ops = ott_cu_ops_of(dst);
    GGML_ASSERT(ops);
    const ggml_tensor * merge = dst->src[0];
    if (merge->op == GGML_OP_OTT_ATTN && merge->src[1] == dst->src[9] && ott_cu_merge_seals(ctx, merge)) {
        // the merge ran this seal in its launch: the same tensors, or the graph broke the contract
        for (int i = 1; i <= 8; ++i) {
            GGML_ASSERT(merge->src[0]->src[i]->data == dst->src[i]->data && "ott: a merge's seal on other tensors");
        }
        return;
    }
    ott_cu_args a = ggml_ott_cu_args(dst);
    // the groups being sealed, as cached: 2*G*D halves per (ubatch stream, KV head)
    ggml_cuda_pool_alloc<uint16_t> scratch(ctx.pool(), (size_t) 2*ops->G*a.D*a.ns*a.H);
    a.scratch = scratch.get();
    ops->seal(&a, ctx.stream());
}
