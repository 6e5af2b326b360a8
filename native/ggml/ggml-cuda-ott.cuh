// ott-gguf: CUDA dispatch of the ott2 cache's ops (ggml-ott.h), called from ggml-cuda.cu
#pragma once

#include "ggml-cuda/common.cuh"

bool ggml_cuda_ott_supports_op(const ggml_tensor * op);
void ggml_cuda_op_ott_attn_part(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_cuda_op_ott_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_cuda_op_ott_seal(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
