// ott-gguf: the ott2 cache's ops on Vulkan (ggml-vulkan-ott.h). Each op binds its buffers in the order of
// gen/generate.py VK_BINDINGS and launches one workgroup per block of the CUDA kernel it was rendered from.
#include "ggml-vulkan-common.h"
#include "ggml-vulkan-ott.h"
#include "ggml-ott-args.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <map>
#include <mutex>

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

// the shaders read and write the state's bytes and halves as 8- and 16-bit storage; the seal sums in fp64 (and both
// divide in it, correctly rounded); a workgroup of the partials holds at most max_subgroups subgroups
struct ott_vk_features {
    bool storage_8_16;
    bool float64;
    uint32_t max_subgroups;
    uint32_t tc; // ggml_vk_ott_tc
    int64_t fuse_blocks; // the merge runs its layer's seal in its dispatch up to this many workgroups (ott_vk_merge_seals)
};

static ott_vk_features ott_vk_device_features(const vk_device & device) {
    static std::mutex mutex;
    static std::map<const vk_device_struct *, ott_vk_features> known;
    std::lock_guard<std::mutex> lock(mutex);
    auto it = known.find(device.get());
    if (it == known.end()) {
        const auto f = device->physical_device.getFeatures2<vk::PhysicalDeviceFeatures2, vk::PhysicalDeviceVulkan11Features,
                                                           vk::PhysicalDeviceVulkan12Features>();
        ott_vk_features r;
        r.storage_8_16 = f.get<vk::PhysicalDeviceVulkan12Features>().storageBuffer8BitAccess &&
                         f.get<vk::PhysicalDeviceVulkan11Features>().storageBuffer16BitAccess;
        // GGML_VK_OTT_DISABLE_F64, as ggml-vulkan's GGML_VK_DISABLE_* variables: act as a device without fp64
        // (Intel Arc), so that the refusal such a device gets can be seen on any device (tests/test_vulkan.py)
        r.float64 = f.get<vk::PhysicalDeviceFeatures2>().features.shaderFloat64 &&
                    getenv("GGML_VK_OTT_DISABLE_F64") == nullptr;
        r.max_subgroups = 0;
        if (device->subgroup_size_control) {
            const auto p = device->physical_device.getProperties2<vk::PhysicalDeviceProperties2,
                                                                  vk::PhysicalDeviceSubgroupSizeControlPropertiesEXT>();
            r.max_subgroups = p.get<vk::PhysicalDeviceSubgroupSizeControlPropertiesEXT>().maxComputeWorkgroupSubgroups;
        }
        // GGML_VK_OTT_TC: read once, so that every dispatch counts the units its pipeline was made for
        const char * e = getenv("GGML_VK_OTT_TC");
        r.tc = device->properties.deviceType == vk::PhysicalDeviceType::eCpu ? 1 : 8;
        if (e != nullptr) {
            const int tc = atoi(e);
            GGML_ASSERT((tc == 1 || tc == 8) && "GGML_VK_OTT_TC must be 1 or 8");
            r.tc = (uint32_t) tc;
        }
        // as CUDA's OTT_CU_FUSED_BLOCKS_PER_SM: the fused shader's workgroups hold the seal's registers and both
        // kernels' shared memory, so a merge of many workgroups (a prefill ubatch's) stays a dispatch of its own;
        // 64 where the device does not say how many cores it has (lavapipe, most mobile GPUs).
        // GGML_VK_OTT_FUSED_BLOCKS sets the bound: 0 never fuses (the A/B on a GPU), a large one always (the tests)
        r.fuse_blocks = device->shader_core_count != 0 ? 2*(int64_t) device->shader_core_count : 64;
        if (const char * fb = getenv("GGML_VK_OTT_FUSED_BLOCKS")) {
            r.fuse_blocks = atoll(fb);
            GGML_ASSERT(r.fuse_blocks >= 0 && "GGML_VK_OTT_FUSED_BLOCKS must be a count of workgroups");
        }
        it = known.emplace(device.get(), r).first;
    }
    return it->second;
}

uint32_t ggml_vk_ott_lanes(const vk_device & device) {
    // GGML_VK_OTT_DISABLE_SUBGROUPS, as GGML_VK_OTT_DISABLE_F64: act as a device that cannot require them
    if (!device->subgroup_basic || !device->subgroup_shuffle || !device->subgroup_size_control ||
        !device->subgroup_require_full_support || getenv("GGML_VK_OTT_DISABLE_SUBGROUPS") != nullptr) {
        return 0;
    }
    const uint32_t w = device->subgroup_max_size < 32 ? device->subgroup_max_size : 32;
    return w >= device->subgroup_min_size && w > 0 && (w & (w - 1)) == 0 ? w : 0;
}

ott2_vk_vec ggml_vk_ott_vec(const vk_device & device, int j, bool kmix) {
    GGML_ASSERT(j >= 0 && j < OTT2_VK_VEC_COUNT);
    const vk::PhysicalDeviceLimits & lim = device->properties.limits;
    const uint32_t W = ggml_vk_ott_lanes(device);
    const uint32_t max_wg = lim.maxComputeWorkGroupInvocations < lim.maxComputeWorkGroupSize[0] ?
        lim.maxComputeWorkGroupInvocations : lim.maxComputeWorkGroupSize[0];
    const uint32_t max_sg = ott_vk_device_features(device).max_subgroups;
    ott2_vk_vec v = ott2_vk_vecs[j];
    while ((ott2_vk_part_shared_bytes(v.cpl, v.rp, v.nw, kmix) > lim.maxComputeSharedMemorySize || (uint32_t) v.nw*W > max_wg ||
            (uint32_t) v.nw > max_sg) && (v.nw > 1 || v.rp > 1)) {
        if (v.nw > 1) {
            v.nw /= 2;
        } else {
            v.rp /= 2;
        }
    }
    return v;
}

uint32_t ggml_vk_ott_tc(const vk_device & device) {
    return ott_vk_device_features(device).tc;
}

// the attention partials' instance for head dimension D: the first whose dmax >= D (supports_op: D <= 512)
static int ott_vk_vec_index(int32_t D) {
    int j = 0;
    while (j + 1 < OTT2_VK_VEC_COUNT && ott2_vk_vecs[j].dmax < D) {
        ++j;
    }
    return j;
}

// the index of op's shader for `kernel` (its head config's), -1 if the build has none
static int ott_vk_shader(const ggml_ott_params & p, const char * kernel) {
    return ott2_vk_find(kernel, p.kbits, p.vbits, (p.flags & GGML_OTT_K_MIX) != 0, (p.flags & GGML_OTT_V_SYM) != 0, p.G, p.Gv);
}

// the shaders index with 32-bit ints (elements of float/int buffers, bytes of the sealed state)
static bool ott_vk_indexable(const ggml_tensor * t) {
    return ggml_nbytes(t) < (size_t) INT32_MAX;
}

bool ggml_vk_ott_supports_op(ggml_backend_dev_t dev, const vk_device & device, const ggml_tensor * op) {
    const ggml_ott_params & p = *ggml_ott_get_params(op);
    switch (op->op) {
        case GGML_OP_OTT_ATTN_PART:
        case GGML_OP_OTT_SEAL: {
            // reads (the seal: writes in place) the cache's state where it lives, never a copy of it, with the
            // kernels of its head config; D up to 512 (4 channels per thread of 128), whole rotation units, sealed
            // groups as laid out here. The seal sums fp16 values exactly in fp64 (shaderFloat64), both divide in
            // it, the partials run a warp's lanes on subgroups the pipeline requires (ggml_vk_ott_lanes).
            const bool seal = op->op == GGML_OP_OTT_SEAL;
            const int i = ott_vk_shader(p, seal ? "seal" : "attn_part");
            const ott_vk_features f = ott_vk_device_features(device);
            if (i < 0 || ggml_ott_k_young(&p) != 0 || ggml_ott_v_young(&p) != 0 || !f.storage_8_16 || !f.float64 ||
                (!seal && ggml_vk_ott_lanes(device) == 0) || p.D > 512 || p.D % p.Gv != 0 || p.D % 32 != 0 ||
                ((p.flags & GGML_OTT_V_ROTATE) && p.D % 64 != 0) || (seal && p.outlier_num > 64)) {
                return false;
            }
            const ott2_vk_key & key = ott2_vk_keys[i];
            if (op->src[4]->ne[0] != (int64_t) p.D*key.KB + (key.kmix ? p.D/4 : 0) ||
                op->src[5]->ne[0] != (int64_t) p.G*(p.D/p.Gv)*key.VB) {
                return false;
            }
            for (int s = 0; s < (seal ? 10 : 9); ++s) {
                const bool state = (s >= 3 && s < 8) || s == 9; // ring, sk, sv, pkv, pmeta; the seal's flags
                if (!ott_vk_indexable(op->src[s]) || (state && !ott_vk_in_buffer_of(dev, op->src[s]))) {
                    return false;
                }
            }
            return ott_vk_indexable(op);
        }
        case GGML_OP_OTT_ATTN: {
            // the merge of partials computed where the cache's state lives
            const ggml_tensor * part = op->src[0];
            return part->op == GGML_OP_OTT_ATTN_PART && ott_vk_in_buffer_of(dev, part->src[3]) &&
                   ott_vk_shader(p, "attn_merge") >= 0 &&
                   part->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 && ggml_is_contiguous(part) &&
                   ggml_is_contiguous(op) && part->ne[0] == p.D + 2 && op->ne[0] == p.D && op->ne[1] == p.n_head &&
                   part->ne[3] % (p.NS + 1) == 0 && op->ne[2] % (part->ne[3]/(p.NS + 1)) == 0 &&
                   ott_vk_indexable(part) && ott_vk_indexable(op);
        }
        default:
            return false;
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

void ggml_vk_ott_attn_part(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst) {
    const ggml_ott_params & p = *ggml_ott_get_params(dst);
    const int i = ott_vk_shader(p, "attn_part");
    GGML_ASSERT(i >= 0);
    const int64_t ns = dst->src[8]->ne[1], n_tok = dst->src[1]->ne[2]/ns;
    vk_pipeline & pipeline = ctx->device->pipeline_ott[i][ott_vk_vec_index(p.D)];
    const int64_t tc = ggml_vk_ott_tc(ctx->device);
    ggml_pipeline_request_descriptor_sets(ctx, pipeline, 1);
    const ott_vk_push pc = ott_vk_push_of(p, ns, n_tok);
    const ggml_tensor * const * s = dst->src;
    ggml_vk_dispatch_pipeline(ctx, subctx, pipeline,
        { ggml_vk_tensor_subbuffer(ctx, s[0]), ggml_vk_tensor_subbuffer(ctx, s[1]), ggml_vk_tensor_subbuffer(ctx, s[2]),
          ggml_vk_tensor_subbuffer(ctx, s[3]), ggml_vk_tensor_subbuffer(ctx, s[4]), ggml_vk_tensor_subbuffer(ctx, s[5]),
          ggml_vk_tensor_subbuffer(ctx, s[6]), ggml_vk_tensor_subbuffer(ctx, s[7]), ggml_vk_tensor_subbuffer(ctx, s[8]),
          ggml_vk_tensor_subbuffer(ctx, dst) }, pc,
        ott_vk_grid(ctx->device, ns*p.H*(p.NS + p.n_head/p.H)*((n_tok + tc - 1)/tc))); // units as the shader's
}

// a tensor in a buffer of this context's device
static bool ott_vk_on_device(const ggml_backend_vk_context * ctx, const ggml_tensor * t) {
    return t->buffer && ggml_backend_buffer_is_vk(t->buffer) &&
           ((const ggml_backend_vk_buffer_context *) t->buffer->context)->dev_buffer->device == ctx->device;
}

// The layer's merge and seal in one dispatch (the attn_merge_seal shader, as CUDA's ott_cu_merge_seals): the seal
// then costs no dispatch and no barriers of its own on the decode steps, which seal nothing on 127 of 128. The merge
// does it when the graph gave it the layer's flags (src[1]: its OTT_SEAL follows on the same tensors; see
// llama_ott_build_attn), the state and the flags live on this device, and the dispatch is small (fuse_blocks). The
// OTT_SEAL node asks the same question and records nothing when the answer is yes.
static bool ott_vk_merge_seals(const ggml_backend_vk_context * ctx, const ggml_tensor * merge) {
    const ggml_tensor * part = merge->src[0];
    const ggml_tensor * flags = merge->src[1];
    if (!flags || part->op != GGML_OP_OTT_ATTN_PART || !ott_vk_on_device(ctx, flags) ||
        !ott_vk_on_device(ctx, part->src[3]) || ott_vk_shader(*ggml_ott_get_params(part), "attn_merge_seal") < 0) {
        return false;
    }
    const ggml_ott_params & p = *ggml_ott_get_params(part);
    const int64_t ns = part->src[8]->ne[1], n_tok = part->src[1]->ne[2]/ns;
    return ns*n_tok*p.n_head + ns*p.H <= ott_vk_device_features(ctx->device).fuse_blocks;
}

// a barrier after an op that wrote the cache's state in place (which ggml-vulkan does not see: the state is among
// its sources), before anything reads it; it orders every earlier write, so ggml-vulkan's own tracking starts over
static void ott_vk_sync_all(ggml_backend_vk_context * ctx, vk_context & subctx) {
    if (vk_enable_sync_logger) { // GGML_VK_SYNC_LOGGER lists ggml-vulkan's own barriers as "sync"
        std::cerr << "sync (ott: after a write of the cache's state)" << std::endl;
    }
    ggml_vk_sync_buffers(ctx, subctx);
    ctx->unsynced_nodes_written.clear();
    ctx->unsynced_nodes_read.clear();
}

void ggml_vk_ott_attn(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst) {
    const ggml_tensor * part = dst->src[0];
    const ggml_ott_params & p = *ggml_ott_get_params(dst);
    // shapes from part F32 [D + 2, gq*n_tok, H, ns*(NS + 1)] and dst F32 [D, n_head, ns*n_tok]
    const int64_t ns = part->ne[3]/(p.NS + 1), n_tok = dst->ne[2]/ns;
    GGML_ASSERT(part->ne[0] == p.D + 2 && part->ne[1] == (int64_t) (p.n_head/p.H)*n_tok && part->ne[2] == p.H);
    const ott_vk_push pc = ott_vk_push_of(p, ns, n_tok);
    if (!ott_vk_merge_seals(ctx, dst)) {
        const int i = ott_vk_shader(p, "attn_merge");
        GGML_ASSERT(i >= 0);
        vk_pipeline & pipeline = ctx->device->pipeline_ott[i][0];
        ggml_pipeline_request_descriptor_sets(ctx, pipeline, 1);
        ggml_vk_dispatch_pipeline(ctx, subctx, pipeline,
            { ggml_vk_tensor_subbuffer(ctx, part), ggml_vk_tensor_subbuffer(ctx, dst) }, pc,
            ott_vk_grid(ctx->device, ns*n_tok*p.n_head));
        return;
    }
    // the seal's part writes the state the partials read: ggml-vulkan put a barrier after them, since this op
    // reads their output
    const int i = ott_vk_shader(*ggml_ott_get_params(part), "attn_merge_seal");
    vk_pipeline & pipeline = ctx->device->pipeline_ott[i][0];
    ggml_pipeline_request_descriptor_sets(ctx, pipeline, 1);
    const ggml_tensor * const * s = part->src;
    ggml_vk_dispatch_pipeline(ctx, subctx, pipeline,
        { ggml_vk_tensor_subbuffer(ctx, part), ggml_vk_tensor_subbuffer(ctx, dst),
          ggml_vk_tensor_subbuffer(ctx, s[1]), ggml_vk_tensor_subbuffer(ctx, s[2]), ggml_vk_tensor_subbuffer(ctx, s[3]),
          ggml_vk_tensor_subbuffer(ctx, s[4]), ggml_vk_tensor_subbuffer(ctx, s[5]), ggml_vk_tensor_subbuffer(ctx, s[6]),
          ggml_vk_tensor_subbuffer(ctx, s[7]), ggml_vk_tensor_subbuffer(ctx, s[8]), ggml_vk_tensor_subbuffer(ctx, dst->src[1]) },
        pc, ott_vk_grid(ctx->device, ns*n_tok*p.n_head + ns*p.H));
    ott_vk_sync_all(ctx, subctx); // one barrier for the state and for the output's readers
}

// dst is the one node ggml-vulkan has listed as written since its last barrier (it lists a node before running it)
static bool ott_vk_listed_alone(const ggml_backend_vk_context * ctx, const ggml_tensor * dst) {
    return ctx->unsynced_nodes_written.size() == 1 && ctx->unsynced_nodes_written[0] == dst;
}

void ggml_vk_ott_seal(ggml_backend_vk_context * ctx, vk_context & subctx, ggml_tensor * dst) {
    const ggml_tensor * merge = dst->src[0];
    if (merge->op == GGML_OP_OTT_ATTN && ott_vk_merge_seals(ctx, merge)) {
        // the merge ran this seal in its dispatch: the same tensors, or the graph broke the contract
        GGML_ASSERT(merge->src[1]->data == dst->src[9]->data && "ott: a merge's seal on other tensors");
        for (int j = 1; j <= 8; ++j) {
            GGML_ASSERT(merge->src[0]->src[j]->data == dst->src[j]->data && "ott: a merge's seal on other tensors");
        }
        // ggml-vulkan has just listed this node's sources as unordered reads, which would put a barrier before the
        // next node that reuses their memory (the projection's output, on k's or v's); the merge read them before
        // its barrier, so when nothing else has been listed since, the lists drop them again
        bool only_this = ott_vk_listed_alone(ctx, dst);
        for (const ggml_tensor * t : ctx->unsynced_nodes_read) {
            only_this = only_this && std::find(dst->src, dst->src + GGML_MAX_SRC, t) != dst->src + GGML_MAX_SRC;
        }
        if (only_this) {
            ctx->unsynced_nodes_written.clear();
            ctx->unsynced_nodes_read.clear();
        }
        return;
    }
    const ggml_ott_params & p = *ggml_ott_get_params(dst);
    const int i = ott_vk_shader(p, "seal");
    GGML_ASSERT(i >= 0);
    const int64_t ns = dst->src[8]->ne[1], n_tok = dst->src[1]->ne[2]/ns;
    vk_pipeline & pipeline = ctx->device->pipeline_ott[i][0];
    ggml_pipeline_request_descriptor_sets(ctx, pipeline, 1);
    const ott_vk_push pc = ott_vk_push_of(p, ns, n_tok);
    const ggml_tensor * const * s = dst->src;
    // ggml-vulkan orders ops by what they write as dst; the seal writes its sources (the state) in place: a
    // barrier before, after every read of the old state (ggml-vulkan has just put one there when the one node it
    // has not ordered is this one: its source, the merge's output, was the last write), and one after, before any
    // later read of the new
    if (!ott_vk_listed_alone(ctx, dst)) {
        if (vk_enable_sync_logger) {
            std::cerr << "sync (ott: before the seal)" << std::endl;
        }
        ggml_vk_sync_buffers(ctx, subctx);
    }
    ggml_vk_dispatch_pipeline(ctx, subctx, pipeline,
        { ggml_vk_tensor_subbuffer(ctx, s[1]), ggml_vk_tensor_subbuffer(ctx, s[2]), ggml_vk_tensor_subbuffer(ctx, s[3]),
          ggml_vk_tensor_subbuffer(ctx, s[4]), ggml_vk_tensor_subbuffer(ctx, s[5]), ggml_vk_tensor_subbuffer(ctx, s[6]),
          ggml_vk_tensor_subbuffer(ctx, s[7]), ggml_vk_tensor_subbuffer(ctx, s[8]), ggml_vk_tensor_subbuffer(ctx, s[9]) },
        pc, ott_vk_grid(ctx->device, ns*p.H)); // a workgroup per (ubatch stream, KV head)
    ott_vk_sync_all(ctx, subctx);
}
