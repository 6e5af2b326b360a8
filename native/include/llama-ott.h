// ott-gguf additions to the llama.cpp C API (bound from Python with ctypes in ott_gguf/_lib.py).
//
// The ott caches are chosen like any K/V cache type: llama_context_params.type_k/type_v set to ggml type ids that
// llama_ott_kv_types lists: ott2, ott3, ott4 (2, 3 or 4 bits per code), kivi2..kivi4 (the same caches without
// outlier tokens). Each side has its own width (type_k = ott3, type_v = ott2: 3-bit keys, 2-bit values); both
// sides must be ott types, or both kivi types. Those ids only select the cache: no tensor ever has such a type. Their parameters travel in a llama_ott_config given per
// context (llama_ott_init_from_model); a context keeps the configuration it was created with.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLAMA_OTT_MAX_LAYERS 256

// Parameters of an ott cache (spec/ott2-algorithm.md); the code widths come from the K/V types (ott3: 3 bits),
// the values per V block (Gv) from the build.
struct llama_ott_config {
    int32_t G;                 // tokens per sealed group; must equal the build's (128)
    int32_t R;                 // fp16 recent window: a group is sealed once R newer tokens follow it
    int32_t outlier_num;       // outlier pool capacity per (sequence, layer, KV head); kivi types use 0
    int32_t aux_cap;           // aux pool capacity per (sequence, layer, KV head)
    int32_t no_outlier_layers; // the first N layers have no outlier pool
    int32_t v_rotate;          // 1: V is quantized from its Hadamard-rotated values (blocks of 64 channels), 0: not
    int32_t k_mix;             // 1: 3-bit keys get their width per channel in each sealed group (2, 3 or 4 bits at
                               // the bytes of 3, docs/k-channel-widths.md); 2: 2-bit keys too (1, 2 or 3 bits at
                               // the bytes of 2, docs/long-context-keys.md); other K widths are unaffected
    int32_t v_sym;             // 1: 2-bit values are stored in symmetric blocks (one fp16 scale, no min: 0.25 bits
                               // per value less, docs/v-blocks.md); needs v_rotate; other V widths are unaffected
    int32_t k_young;           // keys by age: the keys of the newest k_young sealed groups of a 2-bit-key layer are also
                               // held at 3 bits, and attention reads them from there (0: off; at most 16; such a
                               // cache runs on the CPU only so far: docs/long-context.md "Keys by age")
    int32_t v_young;           // values by age: the same for the values of a 2-bit-value layer (0: off; at most 16)
    // code widths per layer: 0 (all by default) gives a layer the widths of the K/V types; otherwise
    // K bits * 16 + V bits (0x43: 4-bit keys, 3-bit values). Sensitive layers can take wider codes and the others
    // narrower ones at the same bytes (docs/layer-widths.md).
    uint8_t layer_widths[LLAMA_OTT_MAX_LAYERS];
};

// The defaults: 128, 32, 3, 32, 2, 1 (docs/fidelity.md says why V is rotated), k_mix 2 (docs/long-context-keys.md), v_sym 0
// (docs/v-blocks.md), k_young 0, v_young 0, no per-layer widths.
LLAMA_API struct llama_ott_config llama_ott_config_default(void);

// Sets cfg->layer_widths from a list of "LAYER[-LAST]:K/V" items separated by commas ("15-24:4/3,0:3/2"; later
// items win; "" clears it). False, with cfg unchanged and the reason in reason (if given), when it does not parse
// or names widths that no type has.
LLAMA_API bool llama_ott_config_set_layer_widths(struct llama_ott_config * cfg, const char * spec, char * reason,
                                                 size_t n);
// Whether this build's caches accept cfg; when not, reason (if given) receives why, naming the field and the
// allowed values.
LLAMA_API bool llama_ott_config_check(const struct llama_ott_config * cfg, char * reason, size_t n);

// llama_init_from_model whose ott caches use cfg (NULL: the defaults). Returns NULL, as llama_init_from_model
// does, when the context cannot be created (an invalid cfg included; llama.cpp's log says why).
LLAMA_API struct llama_context * llama_ott_init_from_model(struct llama_model * model,
                                                           struct llama_context_params params,
                                                           const struct llama_ott_config * cfg);

// For bindings that create contexts through llama_init_from_model themselves (llama-cpp-python): the
// configuration of the ott caches created on the calling thread from now on (NULL: back to the defaults).
// It is copied; other threads are not affected.
LLAMA_API void llama_ott_set_thread_config(const struct llama_ott_config * cfg);

// The ott cache types as ggml type ids (names: ggml_type_name); writes up to n of them into out (may be NULL)
// and returns how many there are.
LLAMA_API int32_t llama_ott_kv_types(enum ggml_type * out, int32_t n);

// "ott-gguf <version>; ott caches: G=.., Gv=.., bits .., kernels <isa>": present only in the patched build, so a
// caller can tell that it loaded ott-gguf's libllama and not a stock one.
LLAMA_API const char * llama_ott_build_info(void);

// Whether the ott caches can serve this model; when not, reason (if given) receives why, naming the
// architecture.
LLAMA_API bool llama_ott_supports_model(const struct llama_model * model, char * reason, size_t n);

// Why the last state load or cache creation on this thread was refused by an ott cache ("" when it was not):
// truncated, corrupt, another cache type, another configuration (naming the field), another format version; an
// unsupported model, mixed K/V types, a device without the ott ops, a failed allocation. llama_state_set_data and
// llama_init_from_model only return a failure code; this names the reason. Setting a configuration
// (llama_ott_set_thread_config, llama_ott_init_from_model) starts with none.
LLAMA_API const char * llama_ott_last_error(void);

// Bytes allocated by the context's K/V cache, whatever its type (the memory module's own breakdown over devices,
// summed; a sliding-window model's two caches together); 0 for a context without one.
LLAMA_API int64_t llama_ott_kv_cache_bytes(const struct llama_context * ctx);

// The configuration of the context's ott cache (kivi types: outlier_num 0); false when it has none.
LLAMA_API bool llama_ott_context_config(const struct llama_context * ctx, struct llama_ott_config * out);

// What the context's ott cache holds, summed over its sequences: out[0] positions held, out[1] positions sealed,
// out[2..4] bytes allocated for the quantized groups, the fp16 tail and the pools, out[5] outlier slots in use,
// out[6] aux slots in use (over layers and heads), out[7] bytes of the f16 window-layer cache of a sliding-window
// model (0 otherwise), out[8] layers served by the ott cache. Returns how many values were written (at most n;
// 0 when the context does not use an ott cache).
LLAMA_API int32_t llama_ott_cache_info(const struct llama_context * ctx, int64_t * out, int32_t n);

// The model layers the context's ott cache serves, ascending (a sliding-window model's window layers keep an f16
// cache): writes up to n of them into out (may be NULL) and returns how many there are (0 without an ott cache).
LLAMA_API int32_t llama_ott_cache_layers(const struct llama_context * ctx, int32_t * out, int32_t n);
// Whether removing positions >= p0 of sequence seq_id (llama_memory_seq_rm(mem, seq_id, p0, -1)) keeps exactly
// what a fresh run over [0, p0) would hold. An ott cache refuses other cuts (seq_rm returns false: a fresh run
// would hold in fp16 tokens it has sealed); a caller that reuses a prompt prefix re-processes from 0 there.
// True for a context without an ott cache, for p0 <= 0 and for p0 at or past the sequence's end.
LLAMA_API bool llama_ott_seq_can_cut(const struct llama_context * ctx, llama_seq_id seq_id, llama_pos p0);

#ifdef __cplusplus
}
#endif
