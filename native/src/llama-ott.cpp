// ott-gguf's entry points inside libllama.
#include "llama-ott.h"

#include "ggml.h"

#include <cstdio>
#include <string>

#ifndef OTT_GGUF_VERSION
#define OTT_GGUF_VERSION "unknown"
#endif

const char * llama_ott_build_info(void) {
    static const std::string info = [] {
        const int64_t blck  = ggml_blck_size(GGML_TYPE_OTT2);
        const size_t  bytes = ggml_type_size(GGML_TYPE_OTT2);
        const int     bits  = (int) ((bytes - 4) * 8 / (size_t) blck); // 4 bytes: fp16 scale and min
        char buf[256];
        snprintf(buf, sizeof(buf), "ott-gguf %s; ggml type %s: %d-bit, %lld values per %zu-byte block",
                 OTT_GGUF_VERSION, ggml_type_name(GGML_TYPE_OTT2), bits, (long long) blck, bytes);
        return std::string(buf);
    }();
    return info.c_str();
}
