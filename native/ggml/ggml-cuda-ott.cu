// ott-gguf: the ott2 cache's ops on CUDA: tensors to kernel arguments, then the generated kernels
// (ott2-cuda-ops.cu, from gen/templates/ott_cuda_ops.j2, the build's head config).
#include "ggml-cuda-ott.cuh"
#include "ggml-ott.h"
#include "ott2-cuda.h"

static const ggml_ott_params & ott_params(const ggml_tensor * t) {
    return *(const ggml_ott_params *) t->op_params;
}

bool ggml_cuda_ott_supports_op(const ggml_tensor * op) {
    const ggml_ott_params & p = ott_params(op);
    // the kernels are generated for one (G, Gv); D up to 512 (4 channels per thread of 128)
    return p.G == OTT2_CU_G && p.Gv == OTT2_CU_GV && p.D <= 512 && p.D % p.Gv == 0;
}

static ott_cu_args ott_args(const ggml_tensor * dst, const ggml_tensor * const * src, bool part) {
    const ggml_ott_params & p = ott_params(dst);
    const ggml_tensor * plan = src[8];
    ott_cu_args a = {};
    a.D = p.D; a.H = p.H; a.n_head = p.n_head; a.T = p.T; a.S = p.S; a.NG = p.NG; a.NS = p.NS;
    a.ns = (int32_t) plan->ne[1];
    a.n_tok = (int32_t) (src[1]->ne[2] / a.ns);
    a.n_stream = p.n_stream; a.outlier_num = p.outlier_num; a.aux_cap = p.aux_cap; a.scale = p.scale;
    a.q = part ? (const float *) src[0]->data : nullptr;
    a.k = (const float *) src[1]->data;
    a.v = (const float *) src[2]->data;
    a.ring = (uint16_t *) src[3]->data;
    a.sk = (uint8_t *) src[4]->data;
    a.sv = (uint8_t *) src[5]->data;
    a.pkv = (uint16_t *) src[6]->data;
    a.pmeta = (int32_t *) src[7]->data;
    a.plan = (const int32_t *) plan->data;
    return a;
}

void ggml_cuda_op_ott_attn_part(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    GGML_ASSERT(ggml_cuda_ott_supports_op(dst));
    ott_cu_args a = ott_args(dst, dst->src, true);
    a.part = (float *) dst->data;
    ott2_cuda_attn_part(&a, ctx.stream());
}

void ggml_cuda_op_ott_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * part = dst->src[0];
    GGML_ASSERT(part->op == GGML_OP_OTT_ATTN_PART);
    ott_cu_args a = ott_args(dst, part->src, false);
    a.part = (float *) part->data;
    a.out = (float *) dst->data;
    ott2_cuda_attn_merge(&a, ctx.stream());
}

void ggml_cuda_op_ott_seal(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    GGML_ASSERT(ggml_cuda_ott_supports_op(dst));
    ott_cu_args a = ott_args(dst, dst->src, false);
    a.flags = (int32_t *) dst->src[9]->data;
    // the groups being sealed, as cached: 2*G*D halves per (ubatch stream, KV head)
    ggml_cuda_pool_alloc<uint16_t> scratch(ctx.pool(), (size_t) 2*OTT2_CU_G*a.D*a.ns*a.H);
    a.scratch = scratch.get();
    ott2_cuda_seal(&a, ctx.stream());
}
