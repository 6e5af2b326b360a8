// ott-gguf: the ott2 cache's ops on Vulkan (ggml-vulkan-ott.h). Each op binds its buffers in the order of
// gen/generate.py VK_BINDINGS and launches one workgroup per block of the CUDA kernel it was rendered from.
#include "ggml-vulkan-common.h"
#include "ggml-vulkan-ott.h"
#include "ggml-ott-args.h"

// the launch grid of n workgroups: rows of at most maxComputeWorkGroupCount[0] (the shader drops the tail)
static std::array<uint32_t, 3> ott_vk_grid(const vk_device & device, int64_t n) {
    const int64_t xmax = device->properties.limits.maxComputeWorkGroupCount[0];
    const int64_t x = n < xmax ? n : xmax;
    const int64_t y = (n + x - 1)/x;
    GGML_ASSERT(y <= device->properties.limits.maxComputeWorkGroupCount[1]);
    return { (uint32_t) x, (uint32_t) y, 1 };
}

static bool ott_vk_in_buffer_of(ggml_backend_dev_t dev, const ggml_tensor * t) {
    return t->buffer && ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer)) == dev;
}

bool ggml_vk_ott_supports_op(ggml_backend_dev_t dev, const vk_device & device, const ggml_tensor * op) {
    (void) device;
    switch (op->op) {
        case GGML_OP_OTT_ATTN: {
            // the merge of partials that were computed where the cache's state lives (never a copy of them)
            const ggml_tensor * part = op->src[0];
            const ggml_ott_params & p = *ggml_ott_get_params(op);
            return part->op == GGML_OP_OTT_ATTN_PART && ott_vk_in_buffer_of(dev, part->src[3]) &&
                   part->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 && ggml_is_contiguous(part) &&
                   ggml_is_contiguous(op) && part->ne[0] == p.D + 2 && op->ne[0] == p.D && op->ne[1] == p.n_head &&
                   part->ne[3] % (p.NS + 1) == 0 && op->ne[2] % (part->ne[3]/(p.NS + 1)) == 0 &&
                   ggml_nelements(part) < INT32_MAX && ggml_nelements(op) < INT32_MAX; // the shaders' 32-bit indices
        }
        default:
            return false; // the partials and the seal have no Vulkan kernels yet: they stay where the cache is refused
    }
}

// the push constants of an op with params p over ns streams of n_tok tokens
static ott_vk_push ott_vk_push_of(const ggml_ott_params & p, int64_t ns, int64_t n_tok) {
    ott_vk_push pc = {};
    pc.D = p.D; pc.H = p.H; pc.n_head = p.n_head; pc.T = p.T; pc.S = p.S; pc.NG = p.NG; pc.NS = p.NS;
    pc.ns = (int32_t) ns; pc.n_tok = (int32_t) n_tok;
    pc.n_stream = p.n_stream; pc.outlier_num = p.outlier_num; pc.aux_cap = p.aux_cap; pc.scale = p.scale;
    pc.v_rotate = (p.flags & GGML_OTT_V_ROTATE) != 0;
    return pc;
}

void ggml_vk_ott_attn(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst) {
    const ggml_tensor * part = dst->src[0];
    const ggml_ott_params & p = *ggml_ott_get_params(dst);
    // shapes from part F32 [D + 2, gq*n_tok, H, ns*(NS + 1)] and dst F32 [D, n_head, ns*n_tok]
    const int64_t ns = part->ne[3]/(p.NS + 1), n_tok = dst->ne[2]/ns;
    GGML_ASSERT(part->ne[0] == p.D + 2 && part->ne[1] == (int64_t) (p.n_head/p.H)*n_tok && part->ne[2] == p.H);
    vk_pipeline & pipeline = ctx->device->pipeline_ott[OTT2_VK_ATTN_MERGE];
    ggml_pipeline_request_descriptor_sets(ctx, pipeline, 1);
    const ott_vk_push pc = ott_vk_push_of(p, ns, n_tok);
    ggml_vk_dispatch_pipeline(ctx, subctx, pipeline,
        { ggml_vk_tensor_subbuffer(ctx, part), ggml_vk_tensor_subbuffer(ctx, dst) }, pc,
        ott_vk_grid(ctx->device, ns*n_tok*p.n_head));
}
