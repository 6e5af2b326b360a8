// ott-gguf: the arguments of the generated CUDA kernels (ott2-cuda.h) from an ott2 op's tensors; used by the
// CUDA dispatch (device pointers) and by ggml-cpu's emulation of the same kernels (host pointers)
#pragma once

#include "ggml-ott.h"
#include "ott2-cuda.h"

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
