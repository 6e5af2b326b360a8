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

// the device's name in ggml (Vulkan0, ...), or NULL
extern "C" const char * ott_vktest_device(int i) {
    char name[32];
    snprintf(name, sizeof(name), "Vulkan%d", i);
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(name);
    return dev ? ggml_backend_dev_description(dev) : nullptr;
}

// the attention (OTT_ATTN_PART, then OTT_ATTN) of the host tensors in `a` on Vulkan device `device`, into a->part
// and a->out. The head config (kbits, vbits, flags as GGML_OTT_*, G, Gv) and the bytes of one head's sealed K and V
// group (kgb, vgb) shape the state tensors. 0 on success; -1: no such device, -2: the device refuses an op,
// -3: compute failed.
extern "C" int ott_vktest_attn(const ott_cu_args * a, int device, int32_t kbits, int32_t vbits, int32_t flags,
        int32_t G, int32_t Gv, int64_t kgb, int64_t vgb) {
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
    ggml_tensor * q     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->D, a->n_head, rows);
    ggml_tensor * k     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->D, a->H, rows);
    ggml_tensor * v     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->D, a->H, rows);
    ggml_tensor * ring  = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, a->D, a->H, a->T, 2*a->n_stream);
    ggml_tensor * sk    = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, kgb, a->NG, a->H, a->n_stream);
    ggml_tensor * sv    = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, vgb, a->NG, a->H, a->n_stream);
    ggml_tensor * pkv   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, a->D, a->S, 2, (int64_t) a->H*a->n_stream);
    ggml_tensor * pmeta = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, 2*a->S + 3, a->H, a->n_stream);
    ggml_tensor * plan  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 4, a->ns);
    ggml_tensor * part  = ggml_ott_attn_part(ctx, q, k, v, ring, sk, sv, pkv, pmeta, plan, &p);
    ggml_tensor * out   = ggml_ott_attn(ctx, part, rows, nullptr, &p);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);

    int rc = 0;
    if (!ggml_backend_supports_op(backend, part) || !ggml_backend_supports_op(backend, out)) {
        rc = -2;
    } else {
        const struct { ggml_tensor * t; const void * host; } ins[] = {
            { q, a->q }, { k, a->k }, { v, a->v }, { ring, a->ring }, { sk, a->sk }, { sv, a->sv }, { pkv, a->pkv },
            { pmeta, a->pmeta }, { plan, a->plan },
        };
        for (const auto & in : ins) {
            ggml_backend_tensor_set(in.t, in.host, 0, ggml_nbytes(in.t));
        }
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out); // the inputs are leaves: only part and out are computed
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
            rc = -3;
        } else {
            ggml_backend_synchronize(backend); // the compute may still run on the device: reads wait for it
            ggml_backend_tensor_get(part, a->part, 0, ggml_nbytes(part));
            ggml_backend_tensor_get(out, a->out, 0, ggml_nbytes(out));
        }
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    ggml_backend_free(backend);
    return rc;
}

// the seal (OTT_SEAL) of the host state in `a` on Vulkan device `device`: k, v, ring, sk, sv, pkv, pmeta, plan
// and flags are uploaded, the op run, and the state it writes (ring, sk, sv, pkv, pmeta, flags) copied back into
// the host buffers. Arguments and return values as ott_vktest_attn.
extern "C" int ott_vktest_seal(const ott_cu_args * a, int device, int32_t kbits, int32_t vbits, int32_t flags,
        int32_t G, int32_t Gv, int64_t kgb, int64_t vgb) {
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
    ggml_tensor * after = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1); // orders the seal in a model's graph only
    ggml_tensor * k     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->D, a->H, rows);
    ggml_tensor * v     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->D, a->H, rows);
    ggml_tensor * ring  = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, a->D, a->H, a->T, 2*a->n_stream);
    ggml_tensor * sk    = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, kgb, a->NG, a->H, a->n_stream);
    ggml_tensor * sv    = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, vgb, a->NG, a->H, a->n_stream);
    ggml_tensor * pkv   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, a->D, a->S, 2, (int64_t) a->H*a->n_stream);
    ggml_tensor * pmeta = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, 2*a->S + 3, a->H, a->n_stream);
    ggml_tensor * plan  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 4, a->ns);
    ggml_tensor * fl    = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, a->n_stream);
    ggml_tensor * seal  = ggml_ott_seal(ctx, after, k, v, ring, sk, sv, pkv, pmeta, plan, fl, &p);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);

    int rc = 0;
    if (!ggml_backend_supports_op(backend, seal)) {
        rc = -2;
    } else {
        const struct { ggml_tensor * t; void * host; } io[] = {
            { k, (void *) a->k }, { v, (void *) a->v }, { ring, a->ring }, { sk, a->sk }, { sv, a->sv },
            { pkv, a->pkv }, { pmeta, a->pmeta }, { plan, (void *) a->plan }, { fl, a->flags },
        };
        for (const auto & t : io) {
            ggml_backend_tensor_set(t.t, t.host, 0, ggml_nbytes(t.t));
        }
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, seal);
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
            rc = -3;
        } else {
            ggml_backend_synchronize(backend);
            for (const auto & t : io) {
                if (t.t != k && t.t != v && t.t != plan) {
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
