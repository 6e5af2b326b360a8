// ott-gguf: CPU forward functions of the ott2 cache's ops, called from ggml-cpu.c's dispatch
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

void ggml_compute_forward_ott_attn_part(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_ott_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_ott_seal(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// Another implementation of the three ops, for tests: the test library of the CUDA kernels' emulation
// (native/tests/ott-cuda-emu.cpp, never installed) registers itself here so that a model's graph runs the CUDA
// path's logic on the CPU. Every thread of the op calls the function with its ith of nth; the op is complete
// when all have returned. NULL restores the CPU code; set it before computing a graph.
struct ggml_ott_cpu_impl {
    void (*attn_part)(struct ggml_tensor * dst, int ith, int nth);
    void (*attn)(struct ggml_tensor * dst, int ith, int nth);
    void (*seal)(struct ggml_tensor * dst, int ith, int nth);
};
GGML_BACKEND_API void ggml_ott_cpu_set_impl(const struct ggml_ott_cpu_impl * impl);

#ifdef __cplusplus
}
#endif
