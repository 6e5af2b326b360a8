// ott-gguf test library: the ott ops on a Vulkan device through ggml's backend API, with the CUDA test entry
// points' contract (host buffers in ott_cu_args; tests/cuda_ops.py). Every tensor of the op lives in one buffer of
// the device; the graph holds only the ops under test, so their inputs are exactly what the host gave.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-ott.h"
#include "ott2-cuda.h"

#include <cstdio>
#include <cstring>
#include <vector>

// the device's name in ggml (Vulkan0, ...), or NULL
extern "C" const char * ott_vktest_device(int i) {
    char name[32];
    snprintf(name, sizeof(name), "Vulkan%d", i);
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(name);
    return dev ? ggml_backend_dev_description(dev) : nullptr;
}

// What ott_vktest_run computes: the attention (OTT_ATTN_PART, then OTT_ATTN, into a->part and a->out); the seal
// (OTT_SEAL: the state it writes, ring, sk, sv, pkv, pmeta and flags, copied back into the host buffers); both in one
// graph as a model's layer has them (the merge given the layer's flags, then the seal: ggml-vulkan may run the seal
// in the merge's dispatch); or the merge given the flags and no seal node after it (what the merge's dispatch did to
// the state shows whether it ran the seal).
enum ott_vktest_mode { OTT_VKTEST_ATTN, OTT_VKTEST_SEAL, OTT_VKTEST_ATTN_SEAL, OTT_VKTEST_ATTN_FLAGS };

// The ops on Vulkan device `device` with the host tensors in `a`. The head config (kbits, vbits, flags as GGML_OTT_*,
// G, Gv) and the bytes of one head's sealed K and V group (kgb, vgb) shape the state tensors. 0 on success; -1: no
// such device, -2: the device refuses an op, -3: compute failed.
static int ott_vktest_run(const ott_cu_args * a, int device, int32_t kbits, int32_t vbits, int32_t flags,
        int32_t G, int32_t Gv, int64_t kgb, int64_t vgb, ott_vktest_mode mode) {
    char name[32];
    snprintf(name, sizeof(name), "Vulkan%d", device);
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(name);
    if (!dev) {
        return -1;
    }
    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    if (!backend) {
        return -1;
    }
    ggml_init_params ip = { 32*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    ggml_ott_params p = {};
    p.D = a->D; p.H = a->H; p.n_head = a->n_head; p.G = G; p.Gv = Gv; p.T = a->T; p.S = a->S; p.NG = a->NG;
    p.n_stream = a->n_stream; p.outlier_num = a->outlier_num; p.aux_cap = a->aux_cap; p.NS = a->NS;
    p.scale = a->scale; p.kbits = kbits; p.vbits = vbits; p.flags = flags;
    const int64_t rows = (int64_t) a->ns*a->n_tok;
    const bool attn = mode != OTT_VKTEST_SEAL, seal = mode == OTT_VKTEST_SEAL || mode == OTT_VKTEST_ATTN_SEAL;
    const bool writes = mode != OTT_VKTEST_ATTN; // the state comes back
    ggml_tensor * q     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->D, a->n_head, rows);
    ggml_tensor * k     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->D, a->H, rows);
    ggml_tensor * v     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->D, a->H, rows);
    ggml_tensor * ring  = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, a->D, a->H, a->T, 2*a->n_stream);
    ggml_tensor * sk    = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, kgb, a->NG, a->H, a->n_stream);
    ggml_tensor * sv    = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, vgb, a->NG, a->H, a->n_stream);
    ggml_tensor * pkv   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, a->D, a->S, 2, (int64_t) a->H*a->n_stream);
    ggml_tensor * pmeta = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, 2*a->S + 3, a->H, a->n_stream);
    ggml_tensor * plan  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 4, a->ns);
    ggml_tensor * fl    = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, a->n_stream);
    ggml_tensor * part  = nullptr;
    ggml_tensor * out   = nullptr;
    std::vector<ggml_tensor *> ops;
    if (attn) {
        part = ggml_ott_attn_part(ctx, q, k, v, ring, sk, sv, pkv, pmeta, plan, &p);
        out  = ggml_ott_attn(ctx, part, rows, mode == OTT_VKTEST_ATTN ? nullptr : fl, &p);
        ops.push_back(part);
        ops.push_back(out);
    }
    if (seal) {
        ggml_tensor * after = out ? out : ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1); // orders the seal after the merge
        ops.push_back(ggml_ott_seal(ctx, after, k, v, ring, sk, sv, pkv, pmeta, plan, fl, &p));
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);

    int rc = 0;
    for (ggml_tensor * op : ops) {
        if (!ggml_backend_supports_op(backend, op)) {
            rc = -2;
        }
    }
    if (rc == 0) {
        const struct { ggml_tensor * t; void * host; bool state; } io[] = {
            { q, (void *) a->q, false }, { k, (void *) a->k, false }, { v, (void *) a->v, false },
            { ring, a->ring, true }, { sk, a->sk, true }, { sv, a->sv, true }, { pkv, a->pkv, true },
            { pmeta, a->pmeta, true }, { plan, (void *) a->plan, false }, { fl, a->flags, true },
        };
        for (const auto & t : io) {
            if (t.host) { // the attention alone has no flags
                ggml_backend_tensor_set(t.t, t.host, 0, ggml_nbytes(t.t));
            }
        }
        ggml_cgraph * gf = ggml_new_graph(ctx);
        for (ggml_tensor * op : ops) {
            ggml_build_forward_expand(gf, op); // the inputs are leaves: only the ops are computed
        }
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
            rc = -3;
        } else {
            ggml_backend_synchronize(backend); // the compute may still run on the device: reads wait for it
            if (attn) {
                ggml_backend_tensor_get(part, a->part, 0, ggml_nbytes(part));
                ggml_backend_tensor_get(out, a->out, 0, ggml_nbytes(out));
            }
            for (const auto & t : io) {
                if (writes && t.state) {
                    ggml_backend_tensor_get(t.t, t.host, 0, ggml_nbytes(t.t));
                }
            }
        }
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    ggml_backend_free(backend);
    return rc;
}

// the attention into a->part and a->out (the merge without flags)
extern "C" int ott_vktest_attn(const ott_cu_args * a, int device, int32_t kbits, int32_t vbits, int32_t flags,
        int32_t G, int32_t Gv, int64_t kgb, int64_t vgb) {
    return ott_vktest_run(a, device, kbits, vbits, flags, G, Gv, kgb, vgb, OTT_VKTEST_ATTN);
}

// the seal of the host state in `a`, written back into its buffers
extern "C" int ott_vktest_seal(const ott_cu_args * a, int device, int32_t kbits, int32_t vbits, int32_t flags,
        int32_t G, int32_t Gv, int64_t kgb, int64_t vgb) {
    return ott_vktest_run(a, device, kbits, vbits, flags, G, Gv, kgb, vgb, OTT_VKTEST_SEAL);
}

// the layer's three ops in one graph (flags_only: the merge given the flags, no seal node): the attention and the
// state
extern "C" int ott_vktest_attn_seal(const ott_cu_args * a, int device, int32_t kbits, int32_t vbits, int32_t flags,
        int32_t G, int32_t Gv, int64_t kgb, int64_t vgb, int flags_only) {
    return ott_vktest_run(a, device, kbits, vbits, flags, G, Gv, kgb, vgb,
                          flags_only ? OTT_VKTEST_ATTN_FLAGS : OTT_VKTEST_ATTN_SEAL);
}
