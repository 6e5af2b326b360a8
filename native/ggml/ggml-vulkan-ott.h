// ott-gguf: the ott2 cache's ops on Vulkan: pipelines from the shaders generated out of the CUDA kernels'
// template (gen/templates/ott_cuda_ops.j2, mode glsl; table ott2-vk.h), supports_op and the dispatch. Included
// by ggml-vulkan.cpp after its own headers (patch 0006); code in ggml-vulkan-ott.cpp.
#pragma once

#include "ott2-vk.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// ott_cu_args' scalars (ott2-cuda.h), the shaders' push constants (ott_vk_push in the generated GLSL)
struct ott_vk_push {
    int32_t D, H, n_head, T, S, NG, NS, ns, n_tok, n_stream, outlier_num, aux_cap;
    float scale;
    int32_t v_rotate;
};

// vk_device_struct::pipeline_ott (patch 0006) holds one pipeline per generated kernel and, for the attention
// partials, per instance (ott2_vk_vecs: the head dimension's)
static_assert(OTT2_VK_COUNT <= sizeof(vk_device_struct::pipeline_ott)/sizeof(vk_device_struct::pipeline_ott[0]), "vk_device_struct::pipeline_ott is too short");
static_assert(OTT2_VK_VEC_COUNT <= sizeof(vk_device_struct::pipeline_ott[0])/sizeof(vk_pipeline), "vk_device_struct::pipeline_ott has too few instances");

// whether `dev` runs op (an ott op); the ops that read or write the cache's state run only where it lives
bool ggml_vk_ott_supports_op(ggml_backend_dev_t dev, const vk_device & device, const ggml_tensor * op);

// record an ott op's dispatch into subctx (ops that supports_op accepted)
void ggml_vk_ott_attn_part(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst);
void ggml_vk_ott_attn(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst);
void ggml_vk_ott_seal(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst);

// the subgroup size W the attention partials' pipelines require (a CUDA warp's 32 lanes on W invocations, 32/W
// lanes each): the largest power of two <= 32 the device can require with full subgroups; 0 where it cannot
// (no subgroup shuffles, no VK_EXT_subgroup_size_control, or only subgroups of 64), and supports_op refuses
uint32_t ggml_vk_ott_lanes(const vk_device & device);
// the attention partials' instance j (ott2_vk_vecs) on this device: CUDA's CPL, RP and NW, NW then RP halved until
// its shared memory and workgroup fit the device's limits (a function of the device and D alone: batch invariance)
ott2_vk_vec ggml_vk_ott_vec(const vk_device & device, int j, bool kmix);
// the attention partials' ubatch tokens per unit: 8, as CUDA's OTT_TC (a prefill ubatch reads each sealed group
// once per 8 tokens), and 1 on a CPU device (lavapipe): llvmpipe ends every loop of a shader invocation after
// 65535 loop iterations counted over all of them (Mesa's LP_MAX_TGSI_LOOP_ITERATIONS), which a unit of 8 tokens'
// rows passes at a few hundred sealed tokens per warp; GGML_VK_OTT_TC=1 or 8 overrides it (tests/test_vulkan_ops.py)
uint32_t ggml_vk_ott_tc(const vk_device & device);

// from ggml_vk_load_shaders, with its pipeline create function: the ott pipelines, compiled on first use as
// every ggml-vulkan pipeline is (the seal and the merge: workgroups of OTT_NT threads; the partials: NW*W
// invocations in subgroups of W; the dispatch counts workgroups)
template <typename F> static void ggml_vk_ott_load_shaders(vk_device & device, const F & create) {
    const uint32_t W = ggml_vk_ott_lanes(device);
    for (int i = 0; i < OTT2_VK_COUNT; ++i) {
        const ott2_vk_shader & s = ott2_vk_shaders[i];
        if (strcmp(ott2_vk_keys[i].kernel, "attn_part") != 0) {
            create(device, device->pipeline_ott[i][0], s.name, s.size, s.spv, "main", s.n_bindings,
                   (uint32_t) sizeof(ott_vk_push), {1, 1, 1}, std::vector<uint32_t>{}, 1);
            continue;
        }
        if (W == 0) {
            continue; // refused by supports_op
        }
        for (int j = 0; j < OTT2_VK_VEC_COUNT; ++j) {
            const ott2_vk_vec v = ggml_vk_ott_vec(device, j, ott2_vk_keys[i].kmix != 0);
            const std::string name = std::string(s.name) + "_d" + std::to_string(v.dmax);
            // specialization constants 0-5 of the shader: W, CPL, RP, NW, the workgroup size NW*W, tokens per unit
            create(device, device->pipeline_ott[i][j], name.c_str(), s.size, s.spv, "main", s.n_bindings,
                   (uint32_t) sizeof(ott_vk_push), {1, 1, 1},
                   std::vector<uint32_t>{ W, (uint32_t) v.cpl, (uint32_t) v.rp, (uint32_t) v.nw, (uint32_t) v.nw*W,
                                          ggml_vk_ott_tc(device) }, 1, false, true, W);
        }
    }
}
