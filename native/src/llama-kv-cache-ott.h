// The ott2 KV cache (docs/design-ott2-cache.md): sealed groups of 2-bit keys (channel-wise) and values
// (token-wise), an fp16 ring of the not-yet-sealed tokens, and outlier/aux pools per (sequence, layer, KV head).
// One sequence per stream; positions of a sequence are consecutive from 0.
#pragma once

#include "llama-batch.h"
#include "llama-graph.h"
#include "llama-memory.h"

#include <map>
#include <memory>
#include <vector>

struct llama_model;
struct llama_hparams;
struct llama_cparams;

struct llama_ott_params {
    uint32_t G                 = 128;
    uint32_t R                 = 32;
    uint32_t outlier_num       = 3;
    uint32_t aux_cap           = 32;
    uint32_t no_outlier_layers = 2;
};

// process-wide defaults for new contexts (set from Python through llama_ott_set_params)
llama_ott_params & llama_ott_default_params();

// true when the requested K/V types select the ott2 (or kivi2) cache
bool llama_ott_selected(ggml_type type_k, ggml_type type_v);

// the cache; throws std::runtime_error with a clear message for unsupported models or parameters
llama_memory_i * llama_kv_cache_ott_create(const llama_model & model, const llama_hparams & hparams,
                                           const llama_cparams & cparams, ggml_type type_k, ggml_type type_v);

class llama_kv_cache_ott;

// per-ubatch, per-stream plan (host side), also the content of the ubatch meta input tensor
struct llama_ott_stream_plan {
    int32_t stream;         // stream (= sequence id)
    int32_t n_pos;          // positions held before the ubatch (its first position)
    int32_t n_sealed;       // groups sealed before the ubatch
    int32_t n_sealed_after; // groups sealed after it
};

class llama_kv_cache_ott_context : public llama_memory_context_i {
public:
    explicit llama_kv_cache_ott_context(llama_memory_status status);
    llama_kv_cache_ott_context(llama_kv_cache_ott * kv, std::vector<llama_ubatch> ubatches,
                               std::vector<std::vector<llama_ott_stream_plan>> plans);
    // a worst-case context for graph reservation
    explicit llama_kv_cache_ott_context(llama_kv_cache_ott * kv);

    bool next() override;
    bool apply() override;
    const llama_ubatch & get_ubatch() const override;
    llama_memory_status get_status() const override;

    llama_kv_cache_ott * get_kv() const { return kv; }
    const std::vector<llama_ott_stream_plan> & get_plan() const;

private:
    llama_memory_status status;
    llama_kv_cache_ott * kv = nullptr;
    size_t i_cur = 0;
    std::vector<llama_ubatch> ubatches;
    std::vector<std::vector<llama_ott_stream_plan>> plans;
    bool is_full = false;
};

// graph input: the ubatch plan as an I32 tensor [4, n_streams_in_ubatch]
class llm_graph_input_attn_kv_ott : public llm_graph_input_attn_kv {
public:
    llm_graph_input_attn_kv_ott(const llama_hparams & hparams, const llama_cparams & cparams,
                                const llama_kv_cache_ott_context * mctx_ott);

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    ggml_tensor * ub_plan = nullptr; // I32 [4, ns]
    uint32_t n_tokens = 0;           // of the ubatch the graph was built for
    const llama_kv_cache_ott_context * mctx_ott;
};

// the hooks called from llama-graph.cpp
std::unique_ptr<llm_graph_input_attn_kv> llama_ott_build_input(ggml_context * ctx0, const llama_ubatch & ubatch,
        const llama_hparams & hparams, const llama_cparams & cparams, const llama_kv_cache_ott_context * mctx);

ggml_tensor * llama_ott_build_attn(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_input_attn_kv_ott * inp,
        ggml_tensor * q_cur, ggml_tensor * k_cur, ggml_tensor * v_cur, float kq_scale, int il);

// ---- sliding-window models (Gemma 3): the ott2 cache for the full-attention layers next to a stock f16
// llama_kv_cache for the window layers, which keeps only the window and gains little from 2 bits.

class llama_kv_cache_context;

class llama_kv_cache_ott_iswa_context : public llama_memory_context_i {
public:
    explicit llama_kv_cache_ott_iswa_context(llama_memory_status status);
    llama_kv_cache_ott_iswa_context(llama_memory_context_ptr ctx_ott, llama_memory_context_ptr ctx_swa);

    bool next() override;
    bool apply() override;
    const llama_ubatch & get_ubatch() const override;
    llama_memory_status get_status() const override;

    const llama_kv_cache_ott_context * get_ott() const;
    const llama_kv_cache_context * get_swa() const;

private:
    llama_memory_status status;
    llama_memory_context_ptr ctx_ott;
    llama_memory_context_ptr ctx_swa;
};

// graph input: the window layers' stock inputs (k/v idxs and mask of the f16 cache) plus the ott2 plan; its
// base-class mctx stays null, which is how build_attn tells it apart
class llm_graph_input_attn_kv_ott_iswa : public llm_graph_input_attn_kv_iswa {
public:
    llm_graph_input_attn_kv_ott_iswa(const llama_hparams & hparams, const llama_cparams & cparams,
                                     const llama_kv_cache_ott_iswa_context * mctx_oi);

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    llm_graph_input_attn_kv_ott ott; // the ott2 part (its plan tensor)
    const llama_kv_cache_ott_iswa_context * mctx_oi;
};

std::unique_ptr<llm_graph_input_attn_kv_iswa> llama_ott_build_input_iswa(ggml_context * ctx0,
        const llama_ubatch & ubatch, const llama_hparams & hparams, const llama_cparams & cparams,
        const llama_kv_cache_ott_iswa_context * mctx);

// the window layers' f16 cache context of an ott2 iSWA input (null for any other input)
const llama_kv_cache_context * llama_ott_iswa_swa_context(const llm_graph_input_attn_kv_iswa * inp);
