// ott-gguf: CPU forward functions of the ott2 cache's ops, called from ggml-cpu.c's dispatch
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

void ggml_compute_forward_ott_attn_part(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_ott_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_ott_seal(const struct ggml_compute_params * params, struct ggml_tensor * dst);

#ifdef __cplusplus
}
#endif
