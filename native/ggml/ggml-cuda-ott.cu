// ott-gguf: the ott2 cache's ops on CUDA: tensors to kernel arguments (ggml-ott-args.h), then the generated
// kernels (ott2-cuda-ops.cu, from gen/templates/ott_cuda_ops.j2, the build's head config).
#include "ggml-cuda-ott.cuh"
#include "ggml-ott-args.h"

bool ggml_cuda_ott_supports_op(const ggml_tensor * op) {
    const ggml_ott_params & p = *ggml_ott_get_params(op);
    // the kernels are generated for one (G, Gv); D up to 512 (4 channels per thread of 128)
    return p.G == OTT2_CU_G && p.Gv == OTT2_CU_GV && p.D <= 512 && p.D % p.Gv == 0;
}

void ggml_cuda_op_ott_attn_part(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    GGML_ASSERT(ggml_cuda_ott_supports_op(dst));
    ott_cu_args a = ggml_ott_cu_args(dst);
    a.part = (float *) dst->data;
    ott2_cuda_attn_part(&a, ctx.stream());
}

void ggml_cuda_op_ott_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * part = dst->src[0];
    GGML_ASSERT(part->op == GGML_OP_OTT_ATTN_PART);
    ott_cu_args a = ggml_ott_cu_args(part); // shapes only: the merge reads `part`
    a.part = (float *) part->data;
    a.out = (float *) dst->data;
    ott2_cuda_attn_merge(&a, ctx.stream());
}

void ggml_cuda_op_ott_seal(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    GGML_ASSERT(ggml_cuda_ott_supports_op(dst));
    ott_cu_args a = ggml_ott_cu_args(dst);
    // the groups being sealed, as cached: 2*G*D halves per (ubatch stream, KV head)
    ggml_cuda_pool_alloc<uint16_t> scratch(ctx.pool(), (size_t) 2*OTT2_CU_G*a.D*a.ns*a.H);
    a.scratch = scratch.get();
    ott2_cuda_seal(&a, ctx.stream());
}
