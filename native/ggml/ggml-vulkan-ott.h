// ott-gguf: the ott2 cache's ops on Vulkan: pipelines from the shaders generated out of the CUDA kernels'
// template (gen/templates/ott_cuda_ops.j2, mode glsl; table ott2-vk.h), supports_op and the dispatch. Included
// by ggml-vulkan.cpp after its own headers (patch 0006); code in ggml-vulkan-ott.cpp.
#pragma once

#include "ott2-vk.h"

#include <cstdint>
#include <vector>

// ott_cu_args' scalars (ott2-cuda.h), the shaders' push constants (ott_vk_push in the generated GLSL)
struct ott_vk_push {
    int32_t D, H, n_head, T, S, NG, NS, ns, n_tok, n_stream, outlier_num, aux_cap;
    float scale;
    int32_t v_rotate;
};

// vk_device_struct::pipeline_ott (patch 0006) holds one pipeline per generated kernel
static_assert(OTT2_VK_COUNT <= sizeof(vk_device_struct::pipeline_ott)/sizeof(vk_pipeline), "vk_device_struct::pipeline_ott is too short");

// whether `dev` runs op (an ott op); the ops that read or write the cache's state run only where it lives
bool ggml_vk_ott_supports_op(ggml_backend_dev_t dev, const vk_device & device, const ggml_tensor * op);

// record an ott op's dispatch into subctx (ops that supports_op accepted)
void ggml_vk_ott_attn_part(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst);
void ggml_vk_ott_attn(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst);
void ggml_vk_ott_seal(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst);

// from ggml_vk_load_shaders, with its pipeline create function: the ott pipelines, compiled on first use as
// every ggml-vulkan pipeline is (workgroups of OTT_NT threads; the dispatch counts workgroups)
template <typename F> static void ggml_vk_ott_load_shaders(vk_device & device, const F & create) {
    for (int i = 0; i < OTT2_VK_COUNT; ++i) {
        const ott2_vk_shader & s = ott2_vk_shaders[i];
        create(device, device->pipeline_ott[i], s.name, s.size, s.spv, "main", s.n_bindings,
               (uint32_t) sizeof(ott_vk_push), {1, 1, 1}, std::vector<uint32_t>{}, 1);
    }
}
