// ott-gguf: the ott2 cache's ops on CUDA: tensors to kernel arguments (ggml-ott-args.h), then the generated
// kernels (ott2-cuda-ops.cu, from gen/templates/ott_cuda_ops.j2, one set per K/V width pair).
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

bool ggml_cuda_ott_supports_op(const ggml_tensor * op) {
    return ott_cu_ops_of(op) != nullptr;
}

void ggml_cuda_op_ott_attn_part(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ott2_cu_ops * ops = ott_cu_ops_of(dst);
    GGML_ASSERT(ops);
    ott_cu_args a = ggml_ott_cu_args(dst);
    a.part = (float *) dst->data;
    ops->attn_part(&a, ctx.stream());
}

void ggml_cuda_op_ott_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * part = dst->src[0];
    GGML_ASSERT(part->op == GGML_OP_OTT_ATTN_PART);
    const ott2_cu_ops * ops = ott_cu_ops_of(part);
    GGML_ASSERT(ops);
    ott_cu_args a = ggml_ott_cu_args(part); // shapes only: the merge reads `part`
    a.part = (float *) part->data;
    a.out = (float *) dst->data;
    ops->attn_merge(&a, ctx.stream());
}

void ggml_cuda_op_ott_seal(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ott2_cu_ops * ops = ott_cu_ops_of(dst);
    GGML_ASSERT(ops);
    ott_cu_args a = ggml_ott_cu_args(dst);
    // the groups being sealed, as cached: 2*G*D halves per (ubatch stream, KV head)
    ggml_cuda_pool_alloc<uint16_t> scratch(ctx.pool(), (size_t) 2*ops->G*a.D*a.ns*a.H);
    a.scratch = scratch.get();
    ops->seal(&a, ctx.stream());
}
