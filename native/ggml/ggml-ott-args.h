// ott-gguf: the arguments of the generated CUDA kernels (ott2-cuda.h) from an ott2 op's tensors; used by the
// CUDA dispatch (device pointers) and by ggml-cpu's emulation of the same kernels (host pointers)
#pragma once

#include "ggml-ott.h"
#include "ott2-cuda.h"

#include <stdio.h>
#include <stdlib.h>

static inline const struct ggml_ott_params * ggml_ott_get_params(const struct ggml_tensor * t) {
    return (const struct ggml_ott_params *) t->op_params;
}

// op: the OTT_ATTN_PART or OTT_SEAL node whose sources are (q or after, k, v, ring, sk, sv, pkv, pmeta, plan[,
// flags]); the caller sets part/out/scratch
static inline ott_cu_args ggml_ott_cu_args(const struct ggml_tensor * op) {
    const struct ggml_ott_params * p = ggml_ott_get_params(op);
    const struct ggml_tensor * plan = op->src[8];
    ott_cu_args a = {};
    a.D = p->D; a.H = p->H; a.n_head = p->n_head; a.T = p->T; a.S = p->S; a.NG = p->NG; a.NS = p->NS;
    a.ns = (int32_t) plan->ne[1];
    a.n_tok = (int32_t) (op->src[1]->ne[2] / a.ns);
    a.n_stream = p->n_stream; a.outlier_num = p->outlier_num; a.aux_cap = p->aux_cap; a.scale = p->scale;
    a.v_rotate = (p->flags & GGML_OTT_V_ROTATE) != 0;
    a.q = op->op == GGML_OP_OTT_ATTN_PART ? (const float *) op->src[0]->data : NULL;
    a.k = (const float *) op->src[1]->data;
    a.v = (const float *) op->src[2]->data;
    a.ring = (uint16_t *) op->src[3]->data;
    a.sk = (uint8_t *) op->src[4]->data;
    a.sv = (uint8_t *) op->src[5]->data;
    a.pkv = (uint16_t *) op->src[6]->data;
    a.pmeta = (int32_t *) op->src[7]->data;
    a.plan = (const int32_t *) plan->data;
    a.flags = op->op == GGML_OP_OTT_SEAL ? (int32_t *) op->src[9]->data : NULL;
    return a;
}

// fprintf and abort rather than GGML_ABORT: the emulation library (native/tests/ott-cuda-emu.cpp) includes this and
// links no ggml
#define OTT_CU_KNOB_ABORT(...) (fprintf(stderr, __VA_ARGS__), fputc('\n', stderr), fflush(stderr), abort())

// A tuning knob for a GPU session (docs/cuda-harness.md "Tuning builds"), not for users: OTT_CUDA_PART=<cpl>,<rp>,<nw>
// runs the attention partials by that instance of the template's SWEEP instead of the launcher's, in builds that
// compile them (CMake OTT_GGUF_CUDA_SWEEP=ON: ott2's default head config), so that the model's decode can be timed
// with the instance `ott-bench --sweep` found fastest without a rebuild. NW changes the order in which a row's items
// are summed (the cache's numbers, not what it computes). Where the instance does not exist the op aborts: never
// another kernel than asked for.
struct ggml_ott_cu_instance {
    int cpl, rp, nw; // 0: the launcher's
};
static inline ggml_ott_cu_instance ggml_ott_cu_instance_env(void) {
    static const ggml_ott_cu_instance inst = [] {
        ggml_ott_cu_instance r = { 0, 0, 0 };
        const char * s = getenv("OTT_CUDA_PART");
        char extra = 0;
        if (s && *s && (sscanf(s, "%d,%d,%d%c", &r.cpl, &r.rp, &r.nw, &extra) != 3 || r.cpl <= 0 || r.rp <= 0 ||
                        r.nw <= 0)) {
            OTT_CU_KNOB_ABORT("ott: OTT_CUDA_PART=%s: expected <channels per lane>,<rows per pass>,<warps>, e.g. 2,4,8",
                              s);
        }
        return r;
    }();
    return inst;
}
static inline void ggml_ott_cu_attn_part(const ott2_cu_ops * ops, const ott_cu_args * a, void * stream) {
    const ggml_ott_cu_instance v = ggml_ott_cu_instance_env();
    if (v.cpl == 0) {
        ops->attn_part(a, stream);
        return;
    }
    if (!ops->attn_part_variant) {
        OTT_CU_KNOB_ABORT("ott: OTT_CUDA_PART is set, but this build has no other instances of the attention partials "
                          "for K %d / V %d bits (a build with -DOTT_GGUF_CUDA_SWEEP=ON has them for ott2's default "
                          "head config)", ops->kbits, ops->vbits);
    }
    if (!ops->attn_part_variant(a, stream, v.cpl, v.rp, v.nw)) {
        OTT_CU_KNOB_ABORT("ott: OTT_CUDA_PART=%d,%d,%d is not an instance of the attention partials at head dimension "
                          "%d (gen/templates/ott_cuda_ops.j2 SWEEP; cpl channels per lane hold D in (16 cpl, 32 cpl])",
                          v.cpl, v.rp, v.nw, (int) a->D);
    }
}
