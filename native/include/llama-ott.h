// ott-gguf additions to the llama.cpp C API. Bound from Python with cffi (ott_gguf/native.py).
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// "ott-gguf <version>; llama-cpp-python <pin>; ott2 <bits>-bit, <group> per block": present only in the
// patched build, so a caller can tell that it loaded ott-gguf's libllama and not a stock one.
LLAMA_API const char * llama_ott_build_info(void);

// Parameters of the ott2 caches created from now on in this process (spec/ott2-algorithm.md):
// G (tokens per group; must equal the build's, 128), R (fp16 recent window), outlier_num (0 = kivi2),
// aux_cap, no_outlier_layers. Contexts created earlier keep theirs.
LLAMA_API void llama_ott_set_params(int32_t G, int32_t R, int32_t outlier_num, int32_t aux_cap, int32_t no_outlier_layers);
// out[5]: the same five values
LLAMA_API void llama_ott_get_params(int32_t * out);
// Whether the ott2 cache can serve this model; when not, reason (if given) receives why, naming the architecture.
LLAMA_API bool llama_ott_supports_model(const struct llama_model * model, char * reason, size_t n);
// What the context's ott2 cache holds, summed over its sequences: out[0] positions held, out[1] positions sealed,
// out[2..4] bytes allocated for the quantized groups, the fp16 tail and the pools, out[5] outlier slots in use,
// out[6] aux slots in use (over layers and heads), out[7] bytes of the f16 window-layer cache of a sliding-window
// model (0 otherwise), out[8] layers served by ott2. Returns how many values were written (at most n; 0 when the
// context does not use the ott2 cache).
LLAMA_API int32_t llama_ott_cache_info(const struct llama_context * ctx, int64_t * out, int32_t n);

#ifdef __cplusplus
}
#endif
