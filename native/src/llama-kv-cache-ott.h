// The ott KV caches (docs/design-ott2-cache.md, docs/architecture.md): sealed groups of 2-bit keys (channel-wise)
// and values (token-wise), an fp16 ring of the not-yet-sealed tokens, and outlier/aux pools per (sequence, layer,
// KV head). One sequence per stream; positions of a sequence are consecutive from 0.
//
// Where each job lives:
//   llama-ott.cpp                 the C API, the K/V type table, configuration, model support, create_memory's hook
//   llama-kv-cache-ott.cpp        allocation, batch planning, the memory context
//   llama-kv-cache-ott-seq.cpp    sequence operations (seq_rm where it is lossless, seq_cp, ...)
//   llama-kv-cache-ott-state.cpp  state save/load
//   llama-kv-cache-ott-graph.cpp  graph inputs and the attention hook (the ggml ops of ggml-ott.h)
//   llama-kv-cache-ott-iswa.cpp   sliding-window models: ott on the full-attention layers, f16 on the window ones
#pragma once

#include "llama-batch.h"
#include "llama-graph.h"
#include "llama-memory.h"
#include "llama-ott.h"

#include "ggml-ott.h"
#include "ott2-head.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

struct llama_model;
struct llama_hparams;
struct llama_cparams;
class llama_kv_cache;
class llama_kv_cache_context;

// ------------------------------------------------------------------------------ selection and configuration

// one ott K/V cache type: a ggml type id that selects the cache, and what it means
struct llama_ott_kv_type {
    ggml_type    type;
    const char * name;
    int32_t      bits;     // code width of K and V
    bool         outliers; // outlier tracing (false: the KIVI baseline of the same width)
};

// whether a layer with kbits-bit keys stores them at widths per channel (kbits +- 1) under cfg.k_mix: level 1 mixes
// 3-bit keys, level 2 2-bit keys too (ott_gguf.kv_types.K_MIX_WIDTHS)
static inline bool llama_ott_k_mixed(const llama_ott_config & cfg, int32_t kbits) {
    return (cfg.k_mix >= 1 && kbits == 3) || (cfg.k_mix >= 2 && kbits == 2);
}

// the cache types of the two sides, resolved once when the cache is created
struct llama_ott_kv_pair {
    char    name[16]; // "ott2", or "ott3/ott2" (K/V) when the sides differ
    int32_t kbits;
    int32_t vbits;
    bool    outliers;
};

// the type's row, or nullptr when `type` is not an ott type
const llama_ott_kv_type * llama_ott_kv_type_of(ggml_type type);

// why the ott caches cannot serve this model ("" when they can)
std::string llama_ott_model_problem(const llama_model & model);

// why this build's caches refuse cfg ("" when they accept it)
std::string llama_ott_config_problem(const llama_ott_config & cfg);

// why cfg does not fit a context of n_ctx_seq tokens per sequence ("" when it does): bounds that keep a
// configuration from allocating what that context can never use
std::string llama_ott_config_problem_ctx(const llama_ott_config & cfg, uint32_t n_ctx_seq);

// the reason of the last refusal on this thread (state loading), for llama_ott_last_error
void llama_ott_record_error(const std::string & msg);

// create_memory's hook: the cache for an ott K/V type (nullptr for other types); throws std::runtime_error with a
// clear message for unsupported models, types or parameters
llama_memory_i * llama_ott_create_memory(const llama_model & model, const llama_cparams & cparams, ggml_type type_k,
                                         ggml_type type_v);

// ------------------------------------------------------------------------------------------------- state

// pool_meta row of one (stream, KV head): S slots of (pos, score) (outlier pool [0, O), aux pool [O, S)), then the
// outlier and aux counts and the tracing flag. The ops share this layout (gen/templates/ott_cuda_ops.j2).
struct ott_meta_row {
    int32_t * d;
    int32_t   S;

    static int64_t len(int32_t S) { return 2*(int64_t) S + 3; }
    ott_slot_meta * slots() const { return (ott_slot_meta *) d; }
    int32_t & n_pool()  const { return d[2*S]; }
    int32_t & n_aux()   const { return d[2*S + 1]; }
    int32_t & tracing() const { return d[2*S + 2]; }
};

struct ott_layer {
    int32_t il;
    ggml_tensor * ring      = nullptr; // F16 [D, H, T, 2*n_stream]: (K, V) of stream s at 2s, 2s+1; slot = pos % T
    ggml_tensor * sealed_k  = nullptr; // I8  [D*KB (+ D/4 k_mix), NG, H, n_stream]: group g = D blocks, channel c
                                       // over G tokens (k_mix: each at its width, then the width table)
                                       // (k_young A: slots NG.. hold a ring of A groups at kbits + 1, group g in
                                       // ring slot g % A: ggml-ott.h, GGML_OTT_K_YOUNG_SHIFT; sealed_v likewise
                                       // with v_young)
    ggml_tensor * sealed_v  = nullptr; // I8  [G*(D/Gv)*VB, NG, H, n_stream]: token t = D/Gv blocks
    ggml_tensor * pool_kv   = nullptr; // F16 [D, S, 2, H*n_stream]: K rows then V rows; pool slots [0, O), aux [O, S)
    ggml_tensor * pool_meta = nullptr; // I32 [ott_meta_row::len(S), H, n_stream]
    ggml_tensor * flags     = nullptr; // I32 [n_stream], one per device (shared by its layers): set by the seal op
                                       // when a stream's new K/V are not finite
    ggml_ott_params op;                // the layer's shapes and parameters, as the ops take them
    size_t young_kbytes = 0;           // k_young: bytes of one young K group (0: the layer has no young keys)
    size_t young_vbytes = 0;           // v_young: bytes of one young V group (0: no young values)

    int32_t young_k() const { return ggml_ott_k_young(&op); }
    int32_t young_v() const { return ggml_ott_v_young(&op); }
    // byte offset in sealed_k of group g's young keys (stream s, head h): ring slot g % A after the NG group slots
    size_t young_k_offset(int32_t s, int32_t h, int32_t g) const {
        return s*sealed_k->nb[3] + h*sealed_k->nb[2] + (size_t) op.NG*sealed_k->nb[1] + (size_t) (g % young_k())*young_kbytes;
    }
    // the same in sealed_v for group g's young values
    size_t young_v_offset(int32_t s, int32_t h, int32_t g) const {
        return s*sealed_v->nb[3] + h*sealed_v->nb[2] + (size_t) op.NG*sealed_v->nb[1] + (size_t) (g % young_v())*young_vbytes;
    }
};

struct ott_stream {
    int32_t n_pos    = 0; // positions [0, n_pos) held
    int32_t n_sealed = 0; // groups [0, n_sealed) sealed
};

// per-ubatch, per-stream plan (host side), also the content of the ubatch plan input tensor
struct llama_ott_stream_plan {
    int32_t stream;         // stream (= sequence id)
    int32_t n_pos;          // positions held before the ubatch (its first position)
    int32_t n_sealed;       // groups sealed before the ubatch
    int32_t n_sealed_after; // groups sealed after it
};

// ------------------------------------------------------------------------------------------------- cache

class llama_kv_cache_ott : public llama_memory_i {
public:
    // cfg: as given by the caller (a kivi type's cache has no outliers whatever cfg says); filter: the layers this
    // cache serves (all when empty)
    llama_kv_cache_ott(const llama_model & model, const llama_cparams & cparams, const llama_ott_kv_pair & kv_type,
                       const llama_ott_config & cfg, const layer_filter_cb & filter = nullptr);
    ~llama_kv_cache_ott() override;

    // llama-kv-cache-ott.cpp: batches
    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;
    llama_memory_context_ptr init_full() override;
    llama_memory_context_ptr init_update(llama_context * lctx, bool optimize) override;
    bool get_can_shift() const override { return false; }

    // splits the batch into ubatches with their per-stream plans; false (error logged) when it cannot be served
    // (seal-aligned: no run of a sequence crosses a position where S changes, see sealed_at)
    bool plan_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, std::vector<llama_ubatch> & ubatches,
                    std::vector<std::vector<llama_ott_stream_plan>> & plans) const;
    void commit(const std::vector<llama_ott_stream_plan> & plan, uint32_t n_tok);
    void read_flags(); // the seal ops' non-finite marks into `poisoned` (before planning a batch)

    // group g is sealed once n_pos - (g+1)G >= R
    int32_t sealed_after(int32_t n_sealed, int32_t n_pos) const {
        return std::max(n_sealed, sealed_at(n_pos));
    }
    // S(p): the groups sealed when position p is processed one token at a time, floor((p - R)/G) (0 below R).
    // Batch invariance: a query at p always sees exactly S(p) groups quantized, however the batch was split.
    int32_t sealed_at(int32_t p) const {
        return p >= cfg.R ? (p - cfg.R) / cfg.G : 0;
    }
    // tokens from position p on that keep S constant (>= 1): a ubatch of a sequence never crosses R + kG
    int32_t seal_headroom(int32_t p) const {
        return cfg.R + (sealed_at(p) + 1)*cfg.G - p;
    }
    // whether keeping [0, p0) of a stream with n_sealed sealed groups leaves what a fresh run over those p0
    // positions holds (its sealed groups are ours, its fp16 tail is ours): S(p0) >= n_sealed
    bool can_cut(int32_t n_sealed, int32_t p0) const {
        return p0 <= 0 || sealed_at(p0) >= n_sealed;
    }

    // llama-kv-cache-ott-seq.cpp: sequences
    void clear(bool data) override;
    bool seq_rm  (llama_seq_id seq_id, llama_pos p0, llama_pos p1) override;
    bool seq_can_cut(llama_seq_id seq_id, llama_pos p0) const; // seq_rm(seq_id, p0, -1) would succeed
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id) override;
    void seq_add (llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) override;
    void seq_div (llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) override;
    llama_pos seq_pos_min(llama_seq_id seq_id) const override;
    llama_pos seq_pos_max(llama_seq_id seq_id) const override;

    // llama-kv-cache-ott-state.cpp: save/load
    void state_write(llama_io_write_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) const override;
    void state_read (llama_io_read_i  & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    // sizes and counters (C API)
    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override;
    void slots_in_use(int64_t & n_outlier, int64_t & n_aux) const; // over every layer, head and stream

    size_t n_layers() const { return layers.size(); }
    int32_t layer_il(size_t i) const { return layers[i].il; } // the model layer of the i-th cache layer
    ott_layer * layer(int32_t il) {
        return il < (int32_t) layer_ids.size() && layer_ids[il] >= 0 ? &layers[layer_ids[il]] : nullptr;
    }

    const llama_ott_kv_pair kv_type;
    const ott_head_kernels * hk; // the per-head kernels of the two widths
    const llama_ott_config cfg; // effective: a kivi type's outlier_num is 0
    const uint32_t n_stream;
    const uint32_t n_ctx_seq;
    size_t bytes_quant = 0, bytes_tail = 0, bytes_pool = 0;
    std::vector<ott_stream> streams;

private:
    void state_write_body(llama_io_write_i & io, llama_seq_id seq_id) const;
    void state_read_body (llama_io_read_i  & io, llama_seq_id seq_id);
    void reset_stream_meta(uint32_t s);
    void release(); // frees the buffers and contexts (the destructor, and a constructor that throws)

    std::vector<ott_layer> layers;
    std::vector<int32_t> layer_ids;
    std::vector<ggml_context *> ctxs;         // one per buffer type (the layers' devices)
    std::vector<ggml_backend_buffer_t> bufs;
    std::vector<ggml_tensor *> flags;         // one per buffer type: read once per batch, not once per layer
    std::vector<uint8_t> poisoned;            // per stream: non-finite K/V were computed; refused until reset
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

// ------------------------------------------------------------------------------------------------- graph

// graph input: the ubatch plan as an I32 tensor [4, n_streams_in_ubatch]
class llm_graph_input_attn_kv_ott : public llm_graph_input_attn_kv {
public:
    llm_graph_input_attn_kv_ott(const llama_hparams & hparams, const llama_cparams & cparams,
                                const llama_kv_cache_ott_context * mctx_ott);

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    // creates the plan tensor for a ubatch
    void build(ggml_context * ctx0, const llama_ubatch & ubatch);

    ggml_tensor * ub_plan = nullptr; // I32 [4, ns]
    uint32_t n_tokens = 0;           // of the ubatch the graph was built for
    const llama_kv_cache_ott_context * mctx_ott;
};

// ---- sliding-window models (Gemma 3): the ott cache for the full-attention layers next to a stock f16
// llama_kv_cache for the window layers, which keeps only the window and gains little from 2 bits.

class llama_kv_cache_ott_iswa : public llama_memory_i {
public:
    llama_kv_cache_ott_iswa(const llama_model & model, const llama_cparams & cparams,
                            const llama_ott_kv_pair & kv_type, const llama_ott_config & cfg);

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;
    llama_memory_context_ptr init_full() override;
    llama_memory_context_ptr init_update(llama_context * lctx, bool optimize) override;
    bool get_can_shift() const override { return false; }

    void clear(bool data) override;
    bool seq_rm  (llama_seq_id seq_id, llama_pos p0, llama_pos p1) override;
    bool seq_can_cut(llama_seq_id seq_id, llama_pos p0) const; // seq_rm(seq_id, p0, -1) would succeed
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id) override;
    void seq_add (llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) override;
    void seq_div (llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) override;
    llama_pos seq_pos_min(llama_seq_id seq_id) const override;
    llama_pos seq_pos_max(llama_seq_id seq_id) const override;

    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override;

    void state_write(llama_io_write_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) const override;
    void state_read (llama_io_read_i  & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    std::unique_ptr<llama_kv_cache_ott> kv_ott;
    std::unique_ptr<llama_kv_cache> kv_swa;
};

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

// graph input: the window layers' stock inputs (k/v idxs and mask of the f16 cache) plus the ott plan
class llm_graph_input_attn_kv_ott_iswa : public llm_graph_input_attn_kv_iswa {
public:
    llm_graph_input_attn_kv_ott_iswa(const llama_hparams & hparams, const llama_cparams & cparams,
                                     const llama_kv_cache_ott_iswa_context * mctx_oi);

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    llm_graph_input_attn_kv_ott ott; // the ott part (its plan tensor)
    const llama_kv_cache_ott_iswa_context * mctx_oi;
};

// ------------------------------------------------------------------------ hooks called from llama-graph.cpp

// the input of an ott cache's memory context (nullptr for any other context)
std::unique_ptr<llm_graph_input_attn_kv> llama_ott_build_input(ggml_context * ctx0, const llama_ubatch & ubatch,
        const llama_hparams & hparams, const llama_cparams & cparams, const llama_memory_context_i * mctx);
std::unique_ptr<llm_graph_input_attn_kv_iswa> llama_ott_build_input_iswa(ggml_context * ctx0,
        const llama_ubatch & ubatch, const llama_hparams & hparams, const llama_cparams & cparams,
        const llama_memory_context_i * mctx);

// the attention core of layer il when `inp` is an ott input and the layer is served by the ott cache: attends
// (2-bit codes read directly) and seals, in the ops of ggml-ott.h; returns [D*n_head, n_tokens]. nullptr
// otherwise: the stock core runs.
ggml_tensor * llama_ott_build_attn(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_input_i * inp,
        ggml_tensor * q_cur, ggml_tensor * k_cur, ggml_tensor * v_cur, ggml_tensor * kq_b, ggml_tensor * sinks,
        ggml_tensor * v_mla, float kq_scale, int il);

// the window layers' f16 cache context of an ott iSWA input (nullptr for any other input)
const llama_kv_cache_context * llama_ott_iswa_swa_context(const llm_graph_input_attn_kv_iswa * inp);
