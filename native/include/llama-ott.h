// ott-gguf additions to the llama.cpp C API. Bound from Python with cffi (ott_gguf/native.py).
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// "ott-gguf <version>; llama-cpp-python <pin>; ott2 <bits>-bit, <group> per block": present only in the
// patched build, so a caller can tell that it loaded ott-gguf's libllama and not a stock one.
LLAMA_API const char * llama_ott_build_info(void);

#ifdef __cplusplus
}
#endif
