// The ott2 KV cache: see llama-kv-cache-ott.h and docs/design-ott2-cache.md.
#include "llama-kv-cache-ott.h"
#include "llama-kv-cache.h"

#include "llama-arch.h"
#include "llama-cparams.h"
#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-ott.h"
#include "ott2-head.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-ott.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

// OTT_GGUF_PARAMS="G,R,outlier_num,aux_cap,no_outlier_layers" sets the defaults of a process (llama-server)
static llama_ott_params ott_params_from_env() {
    llama_ott_params p;
    const char * env = getenv("OTT_GGUF_PARAMS");
    if (env) {
        unsigned v[5];
        if (sscanf(env, "%u,%u,%u,%u,%u", &v[0], &v[1], &v[2], &v[3], &v[4]) == 5) {
            p = { v[0], v[1], v[2], v[3], v[4] };
        } else {
            LLAMA_LOG_ERROR("%s: ignoring OTT_GGUF_PARAMS='%s' (expected G,R,outlier_num,aux_cap,no_outlier_layers)\n",
                            __func__, env);
        }
    }
    return p;
}

llama_ott_params & llama_ott_default_params() {
    static llama_ott_params p = ott_params_from_env();
    return p;
}

bool llama_ott_selected(ggml_type type_k, ggml_type type_v) {
    return type_k == GGML_TYPE_OTT2 || type_v == GGML_TYPE_OTT2;
}


struct ott_layer {
    int32_t il;
    ggml_tensor * ring      = nullptr; // F16 [D, H, T, 2*n_stream]: (K, V) of stream s at 2s, 2s+1; slot = pos % T
    ggml_tensor * sealed_k  = nullptr; // I8  [D*KB, NG, H, n_stream]: group g = D blocks, channel c over G tokens
    ggml_tensor * sealed_v  = nullptr; // I8  [G*(D/Gv)*VB, NG, H, n_stream]: token t = D/Gv blocks
    ggml_tensor * pool_kv   = nullptr; // F16 [D, S, 2, H*n_stream]: K rows then V rows; pool slots [0, O), aux [O, S)
    ggml_tensor * pool_meta = nullptr; // I32 [2S + 3, H, n_stream]: S x (pos, score), n_pool, n_aux, tracing
    ggml_tensor * flags     = nullptr; // I32 [n_stream], one per device (shared by its layers): set by the seal op
                                       // when a stream's new K/V are not finite
    ggml_ott_params op;
};

struct ott_stream {
    int32_t n_pos    = 0; // positions [0, n_pos) held
    int32_t n_sealed = 0; // groups [0, n_sealed) sealed
};

class llama_kv_cache_ott : public llama_memory_i {
public:
    // filter: the layers this cache serves (all when empty)
    llama_kv_cache_ott(const llama_model & model, const llama_hparams & hparams, const llama_cparams & cparams,
                       const llama_ott_params & p, const layer_filter_cb & filter = nullptr);
    ~llama_kv_cache_ott() override;

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;
    // splits the batch into ubatches with their per-stream plans; false (error logged) when it cannot be served
    bool plan_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, std::vector<llama_ubatch> & ubatches,
                    std::vector<std::vector<llama_ott_stream_plan>> & plans) const;
    llama_memory_context_ptr init_full() override;
    llama_memory_context_ptr init_update(llama_context * lctx, bool optimize) override;
    bool get_can_shift() const override { return false; }

    void clear(bool data) override;
    bool seq_rm  (llama_seq_id seq_id, llama_pos p0, llama_pos p1) override;
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id) override;
    void seq_add (llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) override;
    void seq_div (llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) override;
    llama_pos seq_pos_min(llama_seq_id seq_id) const override;
    llama_pos seq_pos_max(llama_seq_id seq_id) const override;

    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override;

    void state_write(llama_io_write_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) const override;
    void state_read (llama_io_read_i  & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    // used by the context and the graph
    int32_t sealed_after(int32_t n_sealed, int32_t n_pos) const {
        // group g is sealed once n_pos - (g+1)G >= R
        const int32_t n = n_pos >= (int32_t) p.R ? (n_pos - (int32_t) p.R) / (int32_t) p.G : 0;
        return std::max(n_sealed, n);
    }
    void commit(const std::vector<llama_ott_stream_plan> & plan, uint32_t n_tok);
    ott_layer * layer(int32_t il) { return il < (int32_t) layer_ids.size() && layer_ids[il] >= 0 ? &layers[layer_ids[il]] : nullptr; }

    void bytes(int64_t & quant, int64_t & tail, int64_t & pool) const {
        quant = (int64_t) bytes_quant; tail = (int64_t) bytes_tail; pool = (int64_t) bytes_pool;
    }
    // outlier and aux pool slots in use, over every layer, head and stream
    void slots_in_use(int64_t & n_outlier, int64_t & n_aux) const {
        n_outlier = n_aux = 0;
        for (const auto & L : layers) {
            std::vector<int32_t> meta(ggml_nelements(L.pool_meta));
            ggml_backend_tensor_get(L.pool_meta, meta.data(), 0, ggml_nbytes(L.pool_meta));
            for (size_t i = 0; i < meta.size(); i += L.pool_meta->ne[0]) {
                n_outlier += meta[i + 2*L.op.S];
                n_aux += meta[i + 2*L.op.S + 1];
            }
        }
    }
    size_t n_layers() const { return layers.size(); }

    const llama_ott_params p;
    const uint32_t n_stream;
    const uint32_t n_ctx_seq;
    std::vector<ott_stream> streams;
    std::vector<uint8_t> poisoned; // per stream: non-finite K/V were computed; refused until the stream is reset
    void read_flags();             // the seal ops' marks into `poisoned` (before planning a batch)

private:
    void reset_stream_meta(uint32_t s);
    void unseal(uint32_t s, llama_pos p0);

    std::vector<ott_layer> layers;
    std::vector<int32_t> layer_ids;
    std::vector<ggml_context *> ctxs;         // one per buffer type (the layers' devices)
    std::vector<ggml_backend_buffer_t> bufs;
    std::vector<ggml_tensor *> flags;         // one per buffer type: read once per batch, not once per layer
    size_t bytes_total = 0;
    size_t bytes_quant = 0, bytes_tail = 0, bytes_pool = 0;
};

// Sliding-window models: the ott2 cache serves the full-attention layers; a stock f16 llama_kv_cache holds the
// window layers (as llama_kv_cache_iswa would, window + ubatch cells). Both see the same ubatches.
class llama_kv_cache_ott_iswa : public llama_memory_i {
public:
    llama_kv_cache_ott_iswa(const llama_model & model, const llama_hparams & hparams, const llama_cparams & cparams,
                            const llama_ott_params & p);

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;
    llama_memory_context_ptr init_full() override;
    llama_memory_context_ptr init_update(llama_context * lctx, bool optimize) override;
    bool get_can_shift() const override { return false; }

    void clear(bool data) override;
    bool seq_rm  (llama_seq_id seq_id, llama_pos p0, llama_pos p1) override;
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

// ------------------------------------------------------------------------------------------- construction

llama_kv_cache_ott::llama_kv_cache_ott(const llama_model & model, const llama_hparams & hparams,
                                       const llama_cparams & cparams, const llama_ott_params & p,
                                       const layer_filter_cb & filter) :
    p(p), n_stream(cparams.n_seq_max),
    // one stream per sequence: a unified context of n_ctx is shared out, not given to each sequence
    n_ctx_seq(cparams.kv_unified && cparams.n_seq_max > 1 ? cparams.n_ctx / cparams.n_seq_max : cparams.n_ctx_seq) {
    const uint32_t n_layer = hparams.n_layer();
    const uint32_t G = p.G, Gv = OTT2_HEAD_GV, T = p.R + p.G;
    const uint32_t S = std::max<uint32_t>(1, p.outlier_num + p.aux_cap);
    const uint32_t NG = (n_ctx_seq + G - 1) / G;

    // a layer's cache lives on its layer's device (offloaded layers: their GPU), as llama_kv_cache places K/V
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    auto ctx_for = [&](ggml_backend_buffer_type_t buft) {
        auto it = ctx_of.find(buft);
        if (it != ctx_of.end()) {
            return it->second;
        }
        ggml_init_params ip = {
            /*.mem_size   =*/ size_t(6u*n_layer + 1)*ggml_tensor_overhead(),
            /*.mem_buffer =*/ NULL,
            /*.no_alloc   =*/ true,
        };
        ggml_context * c = ggml_init(ip);
        if (!c) {
            throw std::runtime_error("ott2: failed to create the ggml context");
        }
        ctx_of[buft] = c;
        ctxs.push_back(c);
        ggml_tensor * f = ggml_new_tensor_1d(c, GGML_TYPE_I32, n_stream);
        ggml_format_name(f, "ott_flags_%zu", flags.size());
        flags.push_back(f);
        bytes_pool += ggml_nbytes(f);
        return c;
    };
    layer_ids.assign(n_layer, -1);
    for (uint32_t il = 0; il < n_layer; ++il) {
        if (filter && !filter((int32_t) il)) {
            continue;
        }
        ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
        if (cparams.offload_kqv) {
            ggml_backend_dev_t dev = model.dev_layer(il);
            const std::string reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
            if (reg != "CPU" && reg != "CUDA") {
                // the ops exist for the CPU and CUDA only: refuse rather than move the cache behind the user's back
                throw std::runtime_error("ott2: layer " + std::to_string(il) + " is offloaded to " + reg +
                                         ", which has no ott2 ops (CPU and CUDA have); offload to CUDA, or keep the "
                                         "K/V cache on the CPU (no_kv_offload / -nkvo)");
            }
            buft = ggml_backend_dev_buffer_type(dev);
        }
        ggml_context * ctx = ctx_for(buft);
        const uint32_t D = hparams.n_embd_head_k(il);
        const uint32_t H = hparams.n_head_kv(il);
        ott_layer L;
        L.il = il;
        L.ring      = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, H, T, 2*n_stream);
        L.sealed_k  = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, (int64_t) D*OTT2_HEAD_KB, NG, H, n_stream);
        L.sealed_v  = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, (int64_t) G*(D/Gv)*OTT2_HEAD_VB, NG, H, n_stream);
        L.pool_kv   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, S, 2, (int64_t) H*n_stream);
        L.pool_meta = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, 2*S + 3, H, n_stream);
        L.flags     = flags[std::find(ctxs.begin(), ctxs.end(), ctx) - ctxs.begin()];
        ggml_format_name(L.ring, "ott_ring_l%d", il);
        ggml_format_name(L.sealed_k, "ott_sealed_k_l%d", il);
        ggml_format_name(L.sealed_v, "ott_sealed_v_l%d", il);
        ggml_format_name(L.pool_kv, "ott_pool_kv_l%d", il);
        ggml_format_name(L.pool_meta, "ott_pool_meta_l%d", il);
        L.op = { (int32_t) D, (int32_t) H, (int32_t) hparams.n_head(il), (int32_t) G, (int32_t) Gv, (int32_t) T,
                 (int32_t) S, (int32_t) NG, (int32_t) n_stream, (int32_t) (il < p.no_outlier_layers ? 0 : p.outlier_num),
                 (int32_t) p.aux_cap, 1, 1.0f };
        bytes_quant += ggml_nbytes(L.sealed_k) + ggml_nbytes(L.sealed_v);
        bytes_tail  += ggml_nbytes(L.ring);
        bytes_pool  += ggml_nbytes(L.pool_kv) + ggml_nbytes(L.pool_meta);
        layer_ids[il] = (int32_t) layers.size();
        layers.push_back(L);
    }
    for (auto & [buft, c] : ctx_of) {
        ggml_backend_buffer_t b = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!b) {
            throw std::runtime_error(std::string("ott2: failed to allocate the cache buffer (") +
                                     ggml_backend_buft_name(buft) + ")");
        }
        // weights usage: the scheduler runs an op where such a source lives, so the ops go to the cache's
        // device and the state, written in place, is never copied to another backend
        ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(b, 0);
        bytes_total += ggml_backend_buffer_get_size(b);
        bufs.push_back(b);
        LLAMA_LOG_INFO("%s: ott2 cache on %s: %7.2f MiB\n", __func__, ggml_backend_buft_name(buft),
                       ggml_backend_buffer_get_size(b)/1048576.0);
    }
    streams.assign(n_stream, {});
    poisoned.assign(n_stream, 0);
    for (uint32_t s = 0; s < n_stream; ++s) {
        reset_stream_meta(s);
    }
    GGML_UNUSED(model);
    LLAMA_LOG_INFO("%s: ott2 cache: %zu layers, %u seqs x %u ctx, G=%u R=%u Gv=%u outliers=%u aux=%u (first %u layers none), "
                   "kernels %s\n", __func__, layers.size(), n_stream, n_ctx_seq, G, p.R, Gv, p.outlier_num, p.aux_cap,
                   p.no_outlier_layers, ott2_head_isa());
    LLAMA_LOG_INFO("%s: ott2 cache size = %7.2f MiB: quantized %7.2f MiB, fp16 tail %7.2f MiB, pools %7.2f MiB\n",
                   __func__, bytes_total/1048576.0, bytes_quant/1048576.0,
                   bytes_tail/1048576.0, bytes_pool/1048576.0);
}

llama_kv_cache_ott::~llama_kv_cache_ott() {
    for (auto * b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (auto * c : ctxs) {
        ggml_free(c);
    }
}

void llama_kv_cache_ott::reset_stream_meta(uint32_t s) {
    for (auto & L : layers) {
        std::vector<int32_t> meta((size_t) L.pool_meta->ne[0]*L.op.H, 0);
        for (int32_t h = 0; h < L.op.H; ++h) {
            meta[(size_t) h*L.pool_meta->ne[0] + 2*L.op.S + 2] = 1; // tracing on
        }
        ggml_backend_tensor_set(L.pool_meta, meta.data(), s*L.pool_meta->nb[2], meta.size()*sizeof(int32_t));
    }
    const int32_t zero = 0;
    for (ggml_tensor * f : flags) {
        ggml_backend_tensor_set(f, &zero, s*sizeof(int32_t), sizeof(int32_t));
    }
    streams[s] = {};
    poisoned[s] = 0;
}

// the seal ops' non-finite marks (one tensor per device, CPU or GPU) into `poisoned`
void llama_kv_cache_ott::read_flags() {
    std::vector<int32_t> v(n_stream);
    for (ggml_tensor * f : flags) {
        ggml_backend_tensor_get(f, v.data(), 0, n_stream*sizeof(int32_t));
        for (uint32_t s = 0; s < n_stream; ++s) {
            poisoned[s] |= v[s] != 0;
        }
    }
}

// why the ott2 cache cannot serve this model ("" when it can)
static std::string ott_model_problem(const llama_model & model, const llama_hparams & hparams) {
    const std::string arch = llm_arch_name(model.arch);
    if (llm_arch_is_recurrent(model.arch) || llm_arch_is_hybrid(model.arch)) {
        return "the " + arch + " architecture keeps a recurrent state; the ott2 cache supports attention-only models";
    }
    if (hparams.is_mla()) {
        return "the " + arch + " architecture uses MLA (compressed latent K/V), which the ott2 cache does not support";
    }
    if (hparams.is_swa_any() && hparams.swa_type != LLAMA_SWA_TYPE_STANDARD) {
        return "the " + arch + " architecture uses a non-standard sliding window, which the ott2 cache does not "
               "support";
    }
    if (hparams.attn_soft_cap) {
        return "the " + arch + " architecture soft-caps attention scores, which the ott2 attention does not do";
    }
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        const uint32_t D = hparams.n_embd_head_k(il);
        if (D != hparams.n_embd_head_v(il) || D % OTT2_HEAD_GV != 0 || D % 16 != 0 || D > 512) {
            return "head dim " + std::to_string(D) + " of " + arch + " is not supported (K and V dims must be equal, a "
                   "multiple of " + std::to_string(OTT2_HEAD_GV) + " and at most 512)";
        }
    }
    return "";
}

bool llama_ott_supports_model(const struct llama_model * model, char * reason, size_t n) {
    const std::string why = ott_model_problem(*model, model->hparams);
    if (reason && n > 0) {
        snprintf(reason, n, "%s", why.c_str());
    }
    return why.empty();
}

llama_memory_i * llama_kv_cache_ott_create(const llama_model & model, const llama_hparams & hparams,
                                           const llama_cparams & cparams, ggml_type type_k, ggml_type type_v) {
    if (type_k != type_v) {
        throw std::runtime_error("ott2: set both the K and the V cache type to ott2 (got " +
                                 std::string(ggml_type_name(type_k)) + " / " + ggml_type_name(type_v) + ")");
    }
    const std::string why = ott_model_problem(model, hparams);
    if (!why.empty()) {
        throw std::runtime_error("ott2: " + why);
    }
    const llama_ott_params & p = llama_ott_default_params();
    if (p.G != OTT2_HEAD_G) {
        throw std::runtime_error("ott2: G=" + std::to_string(p.G) + " but this build's kernels are for G=" +
                                 std::to_string(OTT2_HEAD_G));
    }
    if (p.outlier_num >= p.G || p.outlier_num > 64) {
        throw std::runtime_error("ott2: outlier_num must be below min(G, 65)");
    }
    if (cparams.kv_unified && cparams.n_seq_max > 1) {
        if (hparams.is_swa_any()) {
            throw std::runtime_error("ott2: several sequences of a sliding-window model need separate K/V streams: "
                                     "turn the unified KV cache off (llama-server --no-kv-unified, kv_unified=false)");
        }
        LLAMA_LOG_INFO("%s: ott2 keeps one stream per sequence: the unified KV cache is not used\n", __func__);
    }
    if (hparams.is_swa_any()) {
        return new llama_kv_cache_ott_iswa(model, hparams, cparams, p);
    }
    return new llama_kv_cache_ott(model, hparams, cparams, p);
}

// ------------------------------------------------------------------------------------------------ batches

bool llama_kv_cache_ott::plan_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, std::vector<llama_ubatch> & ubatches,
                                    std::vector<std::vector<llama_ott_stream_plan>> & plans) const {
    balloc.split_reset();
    std::vector<ott_stream> sim = streams;
    while (true) {
        llama_ubatch ub = n_stream == 1 ? balloc.split_simple(n_ubatch) : balloc.split_equal(n_ubatch, true, 0);
        if (ub.n_tokens == 0) {
            break;
        }
        // the ubatch is runs of tokens of one sequence each, all runs of equal length
        std::vector<llama_ott_stream_plan> plan;
        uint32_t run = 0;
        for (uint32_t i = 0; i < ub.n_tokens; ++i) {
            if (ub.n_seq_id[i] != 1) {
                LLAMA_LOG_ERROR("%s: ott2: a token shared by several sequences is not supported\n", __func__);
                return false;
            }
            const llama_seq_id s = ub.seq_id[i][0];
            if (s < 0 || (uint32_t) s >= n_stream) {
                LLAMA_LOG_ERROR("%s: ott2: seq_id %d out of range [0, %u)\n", __func__, s, n_stream);
                return false;
            }
            if (plan.empty() || plan.back().stream != s) {
                plan.push_back({ s, sim[s].n_pos, sim[s].n_sealed, 0 });
                run = 0;
            }
            if (ub.pos[i] != sim[s].n_pos + (llama_pos) run) {
                LLAMA_LOG_ERROR("%s: ott2: sequence %d continues at position %d, got %d (positions must be consecutive; "
                                "remove the tail with seq_rm first)\n", __func__, s, sim[s].n_pos + run, ub.pos[i]);
                return false;
            }
            run++;
            if (i + 1 == ub.n_tokens || ub.seq_id[i + 1][0] != s) {
                if ((uint32_t) sim[s].n_pos + run > n_ctx_seq) {
                    LLAMA_LOG_ERROR("%s: ott2: sequence %d would exceed its context of %u tokens\n", __func__, s, n_ctx_seq);
                    return false;
                }
                sim[s].n_pos += run;
                sim[s].n_sealed = sealed_after(sim[s].n_sealed, sim[s].n_pos);
                plan.back().n_sealed_after = sim[s].n_sealed;
            }
        }
        if (ub.n_tokens % plan.size() != 0) {
            LLAMA_LOG_ERROR("%s: ott2: unequal sequence runs in a ubatch\n", __func__);
            return false;
        }
        for (const auto & pl : plan) {
            if (poisoned[pl.stream]) {
                LLAMA_LOG_ERROR("%s: ott2: sequence %d holds non-finite keys or values (computed by an earlier batch); "
                                "its cache cannot be quantized: clear the sequence (seq_rm over all positions) and "
                                "process it again\n", __func__, pl.stream);
                return false;
            }
            if (std::count_if(plan.begin(), plan.end(), [&](const auto & x) { return x.stream == pl.stream; }) != 1) {
                LLAMA_LOG_ERROR("%s: ott2: a sequence appears twice in one ubatch\n", __func__);
                return false;
            }
        }
        ubatches.push_back(std::move(ub)); // NOLINT
        plans.push_back(std::move(plan));
    }
    return balloc.get_n_used() >= balloc.get_n_tokens();
}

llama_memory_context_ptr llama_kv_cache_ott::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);
    std::vector<llama_ubatch> ubatches;
    std::vector<std::vector<llama_ott_stream_plan>> plans;
    read_flags();
    if (!plan_batch(balloc, n_ubatch, ubatches, plans)) {
        return std::make_unique<llama_kv_cache_ott_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }
    return std::make_unique<llama_kv_cache_ott_context>(this, std::move(ubatches), std::move(plans));
}

llama_memory_context_ptr llama_kv_cache_ott::init_full() {
    return std::make_unique<llama_kv_cache_ott_context>(this);
}

llama_memory_context_ptr llama_kv_cache_ott::init_update(llama_context * lctx, bool optimize) {
    GGML_UNUSED(lctx);
    GGML_UNUSED(optimize);
    return std::make_unique<llama_kv_cache_ott_context>(LLAMA_MEMORY_STATUS_NO_UPDATE);
}

void llama_kv_cache_ott::commit(const std::vector<llama_ott_stream_plan> & plan, uint32_t n_tok) {
    for (const auto & pl : plan) {
        streams[pl.stream].n_pos    = pl.n_pos + (int32_t) n_tok;
        streams[pl.stream].n_sealed = pl.n_sealed_after;
    }
}

// ------------------------------------------------------------------------------------------ sequence ops

void llama_kv_cache_ott::clear(bool data) {
    if (data) {
        for (auto * b : bufs) {
            ggml_backend_buffer_clear(b, 0);
        }
    }
    for (uint32_t s = 0; s < n_stream; ++s) {
        reset_stream_meta(s);
    }
}

bool llama_kv_cache_ott::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    if (p0 < 0) {
        p0 = 0;
    }
    const bool to_end = p1 < 0;
    std::vector<uint32_t> targets;
    if (seq_id < 0) {
        for (uint32_t s = 0; s < n_stream; ++s) {
            targets.push_back(s);
        }
    } else if ((uint32_t) seq_id < n_stream) {
        targets.push_back(seq_id);
    } else {
        return true; // nothing stored for it
    }
    for (uint32_t s : targets) {
        ott_stream & st = streams[s];
        if (p0 >= st.n_pos) {
            continue; // nothing at or after p0
        }
        if (!to_end && p1 < st.n_pos) {
            return false; // a hole in the middle of a sequence: positions must stay consecutive
        }
        if (p0 == 0) {
            reset_stream_meta(s);
            continue;
        }
        if (p0 >= st.n_sealed*(int32_t) p.G) {
            st.n_pos = p0; // inside the fp16 tail: the ring slots past p0 are simply unused
            continue;
        }
        unseal(s, p0);
    }
    return true;
}

// Truncate stream s to [0, p0) with p0 inside sealed group g = p0 / G (as ott_gguf.reference.truncate does):
// groups below g stay sealed; the tokens [gG, p0) come back into the fp16 ring as they were served (pooled ones
// exact); pool and aux entries at or after gG are dropped; later groups are forgotten.
void llama_kv_cache_ott::unseal(uint32_t s, llama_pos p0) {
    const int32_t G = (int32_t) p.G;
    const int32_t g = p0 / G, lo = g*G, n_keep = p0 - lo;
    // a rare memory operation: the head's group, pools and meta come to the host (wherever the cache lives),
    // are edited there and written back
    for (auto & L : layers) {
        const int32_t D = L.op.D, S = L.op.S, O = L.op.outlier_num;
        const size_t row = (size_t) D*sizeof(uint16_t);
        std::vector<uint16_t> k((size_t) G*D), v((size_t) G*D), pool((size_t) 2*S*D);
        std::vector<char> skb(L.sealed_k->nb[1]), svb(L.sealed_v->nb[1]);
        std::vector<int32_t> meta(L.pool_meta->ne[0]);
        for (int32_t h = 0; h < L.op.H; ++h) {
            ggml_backend_tensor_get(L.sealed_k, skb.data(), h*L.sealed_k->nb[2] + s*L.sealed_k->nb[3] + g*L.sealed_k->nb[1], skb.size());
            ggml_backend_tensor_get(L.sealed_v, svb.data(), h*L.sealed_v->nb[2] + s*L.sealed_v->nb[3] + g*L.sealed_v->nb[1], svb.size());
            ott2_head_unseal((int) D, skb.data(), svb.data(), n_keep, k.data(), v.data());
            const size_t meta_off = h*L.pool_meta->nb[1] + s*L.pool_meta->nb[2];
            const size_t pool_off = (h + L.op.H*s)*L.pool_kv->nb[3];
            ggml_backend_tensor_get(L.pool_meta, meta.data(), meta_off, meta.size()*sizeof(int32_t));
            ggml_backend_tensor_get(L.pool_kv, pool.data(), pool_off, pool.size()*sizeof(uint16_t));
            ott_slot_meta * slots = (ott_slot_meta *) meta.data();
            // the pools: entries inside [lo, p0) cover their placeholders, entries from lo on are dropped
            const int32_t counts[2] = { meta[2*S], meta[2*S + 1] };
            const int32_t base[2] = { 0, O };
            for (int which = 0; which < 2; ++which) {
                int32_t kept = 0;
                for (int32_t i = 0; i < counts[which]; ++i) {
                    const int32_t slot = base[which] + i;
                    const int32_t pos = slots[slot].pos;
                    if (pos >= lo && pos < p0) {
                        memcpy(&k[(size_t) (pos - lo)*D], &pool[(size_t) slot*D], row);
                        memcpy(&v[(size_t) (pos - lo)*D], &pool[(size_t) (S + slot)*D], row);
                    }
                    if (pos >= lo) {
                        continue;
                    }
                    const int32_t dst = base[which] + kept++;
                    if (dst != slot) {
                        slots[dst] = slots[slot];
                        memcpy(&pool[(size_t) dst*D], &pool[(size_t) slot*D], row);
                        memcpy(&pool[(size_t) (S + dst)*D], &pool[(size_t) (S + slot)*D], row);
                    }
                }
                meta[2*S + which] = kept;
            }
            ggml_backend_tensor_set(L.pool_meta, meta.data(), meta_off, meta.size()*sizeof(int32_t));
            ggml_backend_tensor_set(L.pool_kv, pool.data(), pool_off, pool.size()*sizeof(uint16_t));
            for (int32_t t = 0; t < n_keep; ++t) {
                const int32_t pos = lo + t;
                const size_t off = h*L.ring->nb[1] + (pos % L.op.T)*L.ring->nb[2];
                ggml_backend_tensor_set(L.ring, &k[(size_t) t*D], off + (2*s + 0)*L.ring->nb[3], row);
                ggml_backend_tensor_set(L.ring, &v[(size_t) t*D], off + (2*s + 1)*L.ring->nb[3], row);
            }
        }
    }
    streams[s].n_sealed = g;
    streams[s].n_pos = p0;
}

void llama_kv_cache_ott::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    GGML_UNUSED(p0);
    GGML_UNUSED(p1);
    if (seq_id_src == seq_id_dst || seq_id_src < 0 || seq_id_dst < 0 ||
        (uint32_t) seq_id_src >= n_stream || (uint32_t) seq_id_dst >= n_stream) {
        return;
    }
    // copy every per-stream slice of every tensor (the stream is the outermost dimension of each)
    for (auto & L : layers) {
        // the stream is dim 3 of the sealed tensors and dim 2 of the pool metadata
        const std::pair<ggml_tensor *, size_t> per_stream[] = {
            { L.sealed_k, L.sealed_k->nb[3] }, { L.sealed_v, L.sealed_v->nb[3] }, { L.pool_meta, L.pool_meta->nb[2] },
            { L.ring, 2*L.ring->nb[3] }, { L.pool_kv, L.op.H*L.pool_kv->nb[3] },
        };
        std::vector<char> tmp;
        for (const auto & [t, sz] : per_stream) {
            tmp.resize(sz);
            ggml_backend_tensor_get(t, tmp.data(), seq_id_src*sz, sz);
            ggml_backend_tensor_set(t, tmp.data(), seq_id_dst*sz, sz);
        }
    }
    for (ggml_tensor * f : flags) {
        int32_t v = 0;
        ggml_backend_tensor_get(f, &v, seq_id_src*sizeof(int32_t), sizeof(int32_t));
        ggml_backend_tensor_set(f, &v, seq_id_dst*sizeof(int32_t), sizeof(int32_t));
    }
    streams[seq_id_dst] = streams[seq_id_src];
    poisoned[seq_id_dst] = poisoned[seq_id_src];
}

void llama_kv_cache_ott::seq_keep(llama_seq_id seq_id) {
    for (uint32_t s = 0; s < n_stream; ++s) {
        if ((llama_seq_id) s != seq_id) {
            reset_stream_meta(s);
        }
    }
}

void llama_kv_cache_ott::seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    GGML_UNUSED(seq_id);
    GGML_UNUSED(p0);
    GGML_UNUSED(p1);
    if (shift != 0) {
        LLAMA_LOG_ERROR("%s: ott2: shifting positions (context shift) is not supported; nothing was changed\n", __func__);
    }
}

void llama_kv_cache_ott::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    GGML_UNUSED(seq_id);
    GGML_UNUSED(p0);
    GGML_UNUSED(p1);
    if (d != 1) {
        LLAMA_LOG_ERROR("%s: ott2: dividing positions is not supported; nothing was changed\n", __func__);
    }
}

llama_pos llama_kv_cache_ott::seq_pos_min(llama_seq_id seq_id) const {
    if (seq_id < 0 || (uint32_t) seq_id >= n_stream || streams[seq_id].n_pos == 0) {
        return -1;
    }
    return 0;
}

llama_pos llama_kv_cache_ott::seq_pos_max(llama_seq_id seq_id) const {
    if (seq_id < 0 || (uint32_t) seq_id >= n_stream) {
        return -1;
    }
    return streams[seq_id].n_pos - 1;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_kv_cache_ott::memory_breakdown() const {
    std::map<ggml_backend_buffer_type_t, size_t> out;
    for (auto * b : bufs) {
        out[ggml_backend_buffer_get_type(b)] += ggml_backend_buffer_get_size(b);
    }
    return out;
}

// state I/O of tensor bytes wherever the tensor lives (host or device memory)
static void ott_write_tensor(llama_io_write_i & io, const ggml_tensor * t, size_t off, size_t n) {
    if (n == 0) {
        return;
    }
    std::vector<char> tmp(n);
    ggml_backend_tensor_get(t, tmp.data(), off, n);
    io.write(tmp.data(), n);
}

static void ott_read_tensor(llama_io_read_i & io, ggml_tensor * t, size_t off, size_t n) {
    if (n == 0) {
        return;
    }
    std::vector<char> tmp(n);
    io.read(tmp.data(), n);
    ggml_backend_tensor_set(t, tmp.data(), off, n);
}

// State: magic, version, the configuration and per-layer shapes (a state of another cache type or another
// configuration is refused), then per stream its counters and the used parts of every tensor.
static const uint32_t OTT_STATE_MAGIC   = 0x3254544f; // "OTT2"
static const uint32_t OTT_STATE_VERSION = 2; // 2: only the used ring rows and pool slots

void llama_kv_cache_ott::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    GGML_UNUSED(flags);
    const uint32_t hdr[9] = { OTT_STATE_MAGIC, OTT_STATE_VERSION, p.G, p.R, OTT2_HEAD_GV, p.outlier_num, p.aux_cap,
                              p.no_outlier_layers, (uint32_t) layers.size() };
    io.write(hdr, sizeof(hdr));
    for (const auto & L : layers) {
        const uint32_t shape[4] = { (uint32_t) L.op.D, (uint32_t) L.op.H, (uint32_t) L.op.T, (uint32_t) L.op.S };
        io.write(shape, sizeof(shape));
    }
    std::vector<uint32_t> which;
    for (uint32_t s = 0; s < n_stream; ++s) {
        if (seq_id < 0 || (uint32_t) seq_id == s) {
            which.push_back(s);
        }
    }
    const uint32_t n = (uint32_t) which.size();
    io.write(&n, sizeof(n));
    for (uint32_t s : which) {
        const int32_t rec[3] = { (int32_t) s, streams[s].n_pos, streams[s].n_sealed };
        io.write(rec, sizeof(rec));
        for (const auto & L : layers) {
            for (int32_t h = 0; h < L.op.H; ++h) {
                const size_t nsk = (size_t) streams[s].n_sealed*L.sealed_k->nb[1];
                const size_t nsv = (size_t) streams[s].n_sealed*L.sealed_v->nb[1];
                ott_write_tensor(io, L.sealed_k, h*L.sealed_k->nb[2] + s*L.sealed_k->nb[3], nsk);
                ott_write_tensor(io, L.sealed_v, h*L.sealed_v->nb[2] + s*L.sealed_v->nb[3], nsv);
                // the ring rows of the positions not sealed yet, then the pools' meta and their used slots only
                for (int kv = 0; kv < 2; ++kv) {
                    for (int32_t pos = streams[s].n_sealed*(int32_t) p.G; pos < streams[s].n_pos; ++pos) {
                        ott_write_tensor(io, L.ring, h*L.ring->nb[1] + (pos % L.op.T)*L.ring->nb[2] +
                                         (2*s + kv)*L.ring->nb[3], L.op.D*sizeof(ggml_fp16_t));
                    }
                }
                std::vector<int32_t> meta(L.pool_meta->ne[0]);
                ggml_backend_tensor_get(L.pool_meta, meta.data(), h*L.pool_meta->nb[1] + s*L.pool_meta->nb[2],
                                        L.pool_meta->nb[1]);
                io.write(meta.data(), L.pool_meta->nb[1]);
                const size_t pool = (h + L.op.H*s)*L.pool_kv->nb[3];
                const size_t row = L.op.D*sizeof(ggml_fp16_t);
                const int32_t O = L.op.outlier_num;
                for (int kv = 0; kv < 2; ++kv) {
                    ott_write_tensor(io, L.pool_kv, pool + (kv*L.op.S)*row, (size_t) meta[2*L.op.S]*row);
                    ott_write_tensor(io, L.pool_kv, pool + (kv*L.op.S + O)*row, (size_t) meta[2*L.op.S + 1]*row);
                }
            }
        }
    }
}

void llama_kv_cache_ott::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    GGML_UNUSED(flags);
    uint32_t hdr[9];
    io.read(hdr, sizeof(hdr));
    if (hdr[0] != OTT_STATE_MAGIC) {
        throw std::runtime_error("ott2: this state was not saved from an ott2 cache (another K/V cache type?)");
    }
    if (hdr[1] != OTT_STATE_VERSION) {
        throw std::runtime_error("ott2: state version " + std::to_string(hdr[1]) + ", this build reads version " +
                                 std::to_string(OTT_STATE_VERSION));
    }
    const uint32_t mine[7] = { p.G, p.R, OTT2_HEAD_GV, p.outlier_num, p.aux_cap, p.no_outlier_layers,
                               (uint32_t) layers.size() };
    const char * names[7] = { "G", "R", "Gv", "outlier_num", "aux_cap", "no_outlier_layers", "n_layer" };
    for (int i = 0; i < 7; ++i) {
        if (hdr[2 + i] != mine[i]) {
            throw std::runtime_error(std::string("ott2: the state was saved with ") + names[i] + "=" +
                                     std::to_string(hdr[2 + i]) + ", this cache has " + names[i] + "=" +
                                     std::to_string(mine[i]));
        }
    }
    for (const auto & L : layers) {
        uint32_t shape[4];
        io.read(shape, sizeof(shape));
        if (shape[0] != (uint32_t) L.op.D || shape[1] != (uint32_t) L.op.H || shape[2] != (uint32_t) L.op.T || shape[3] != (uint32_t) L.op.S) {
            throw std::runtime_error("ott2: the state's layer shapes differ from this model's");
        }
    }
    uint32_t n = 0;
    io.read(&n, sizeof(n));
    if (seq_id >= 0 && n != 1) {
        throw std::runtime_error("ott2: a sequence state must hold exactly one sequence");
    }
    if (seq_id < 0) {
        clear(true);
    }
    for (uint32_t i = 0; i < n; ++i) {
        int32_t rec[3];
        io.read(rec, sizeof(rec));
        const int32_t s = seq_id >= 0 ? seq_id : rec[0];
        if (s < 0 || (uint32_t) s >= n_stream || rec[1] < 0 || (uint32_t) rec[1] > n_ctx_seq || rec[2] < 0 ||
            (int64_t) rec[2]*p.G > rec[1]) {
            throw std::runtime_error("ott2: the state does not fit this context (sequence " + std::to_string(s) +
                                     ", " + std::to_string(rec[1]) + " positions)");
        }
        reset_stream_meta((uint32_t) s); // counters, pool meta and the non-finite mark start over
        for (auto & L : layers) {
            for (int32_t h = 0; h < L.op.H; ++h) {
                ott_read_tensor(io, L.sealed_k, h*L.sealed_k->nb[2] + s*L.sealed_k->nb[3], (size_t) rec[2]*L.sealed_k->nb[1]);
                ott_read_tensor(io, L.sealed_v, h*L.sealed_v->nb[2] + s*L.sealed_v->nb[3], (size_t) rec[2]*L.sealed_v->nb[1]);
                for (int kv = 0; kv < 2; ++kv) {
                    for (int32_t pos = rec[2]*(int32_t) p.G; pos < rec[1]; ++pos) {
                        ott_read_tensor(io, L.ring, h*L.ring->nb[1] + (pos % L.op.T)*L.ring->nb[2] +
                                        (2*s + kv)*L.ring->nb[3], L.op.D*sizeof(ggml_fp16_t));
                    }
                }
                std::vector<int32_t> meta(L.pool_meta->ne[0]);
                io.read(meta.data(), L.pool_meta->nb[1]);
                const int32_t O = L.op.outlier_num;
                if (meta[2*L.op.S] < 0 || meta[2*L.op.S] > O || meta[2*L.op.S + 1] < 0 ||
                    meta[2*L.op.S + 1] > L.op.S - O) {
                    reset_stream_meta((uint32_t) s);
                    throw std::runtime_error("ott2: the state's pool counts are out of range (a corrupt state)");
                }
                ggml_backend_tensor_set(L.pool_meta, meta.data(), h*L.pool_meta->nb[1] + s*L.pool_meta->nb[2],
                                        L.pool_meta->nb[1]);
                const size_t pool = (h + L.op.H*s)*L.pool_kv->nb[3];
                const size_t row = L.op.D*sizeof(ggml_fp16_t);
                for (int kv = 0; kv < 2; ++kv) {
                    ott_read_tensor(io, L.pool_kv, pool + (kv*L.op.S)*row, (size_t) meta[2*L.op.S]*row);
                    ott_read_tensor(io, L.pool_kv, pool + (kv*L.op.S + O)*row, (size_t) meta[2*L.op.S + 1]*row);
                }
            }
        }
        streams[s].n_pos = rec[1];
        streams[s].n_sealed = rec[2];
    }
}

// ---------------------------------------------------------------------------------------------- context

llama_kv_cache_ott_context::llama_kv_cache_ott_context(llama_memory_status status) : status(status) {}

llama_kv_cache_ott_context::llama_kv_cache_ott_context(llama_kv_cache_ott * kv, std::vector<llama_ubatch> ubatches,
        std::vector<std::vector<llama_ott_stream_plan>> plans) :
    status(LLAMA_MEMORY_STATUS_SUCCESS), kv(kv), ubatches(std::move(ubatches)), plans(std::move(plans)) {}

llama_kv_cache_ott_context::llama_kv_cache_ott_context(llama_kv_cache_ott * kv) :
    status(LLAMA_MEMORY_STATUS_SUCCESS), kv(kv), is_full(true) {}

bool llama_kv_cache_ott_context::next() {
    return ++i_cur < ubatches.size();
}

bool llama_kv_cache_ott_context::apply() {
    if (is_full || ubatches.empty()) {
        return true;
    }
    const llama_ubatch & ub = ubatches[i_cur];
    kv->commit(plans[i_cur], ub.n_tokens / (uint32_t) plans[i_cur].size());
    return true;
}

const llama_ubatch & llama_kv_cache_ott_context::get_ubatch() const {
    GGML_ASSERT(i_cur < ubatches.size());
    return ubatches[i_cur];
}

llama_memory_status llama_kv_cache_ott_context::get_status() const {
    return status;
}

const std::vector<llama_ott_stream_plan> & llama_kv_cache_ott_context::get_plan() const {
    static const std::vector<llama_ott_stream_plan> none;
    return is_full || i_cur >= plans.size() ? none : plans[i_cur];
}

// ------------------------------------------------------------------------------------------- graph input

llm_graph_input_attn_kv_ott::llm_graph_input_attn_kv_ott(const llama_hparams & hparams, const llama_cparams & cparams,
        const llama_kv_cache_ott_context * mctx_ott) :
    llm_graph_input_attn_kv(hparams, cparams, nullptr), mctx_ott(mctx_ott) {}

void llm_graph_input_attn_kv_ott::set_input(const llama_ubatch * ubatch) {
    GGML_UNUSED(ubatch);
    GGML_ASSERT(ub_plan && ggml_backend_buffer_is_host(ub_plan->buffer));
    const auto & plan = mctx_ott->get_plan();
    GGML_ASSERT((int64_t) plan.size() == ub_plan->ne[1]);
    int32_t * d = (int32_t *) ub_plan->data;
    for (size_t i = 0; i < plan.size(); ++i) {
        d[4*i + 0] = plan[i].stream;
        d[4*i + 1] = plan[i].n_pos;
        d[4*i + 2] = plan[i].n_sealed;
        d[4*i + 3] = plan[i].n_sealed_after;
    }
}

// The ops take everything that changes between ubatches (positions, sealed counts, which streams) from the plan
// input, so a graph built for the same shape (tokens per stream, number of streams) serves again.
bool llm_graph_input_attn_kv_ott::can_reuse(const llm_graph_params & params) {
    const auto * m = dynamic_cast<const llama_kv_cache_ott_context *>(params.mctx);
    if (!m || m->get_kv() != mctx_ott->get_kv()) {
        return false;
    }
    mctx_ott = m;
    return ub_plan->ne[1] == (int64_t) m->get_plan().size() && params.ubatch.n_tokens == n_tokens;
}

std::unique_ptr<llm_graph_input_attn_kv> llama_ott_build_input(ggml_context * ctx0, const llama_ubatch & ubatch,
        const llama_hparams & hparams, const llama_cparams & cparams, const llama_kv_cache_ott_context * mctx) {
    auto inp = std::make_unique<llm_graph_input_attn_kv_ott>(hparams, cparams, mctx);
    int64_t ns = (int64_t) mctx->get_plan().size();
    if (ns == 0) {
        ns = std::max<int64_t>(1, ubatch.n_seqs_unq); // graph reservation
    }
    inp->n_tokens = ubatch.n_tokens;
    inp->ub_plan = ggml_new_tensor_2d(ctx0, GGML_TYPE_I32, 4, ns);
    ggml_set_input(inp->ub_plan);
    return inp;
}

// ------------------------------------------------------------------------------------------------- ops

// the layer's three ops (ggml-ott.h): attention partials, their merge, then the seal. They run where the
// layer's cache lives (CPU or CUDA): the state tensors sit in a weights-usage buffer of the layer's device,
// so the scheduler places the ops with them and never copies the state.
ggml_tensor * llama_ott_build_attn(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_input_attn_kv_ott * inp,
        ggml_tensor * q_cur, ggml_tensor * k_cur, ggml_tensor * v_cur, float kq_scale, int il) {
    llama_kv_cache_ott * kv = inp->mctx_ott->get_kv();
    ott_layer * L = kv->layer(il);
    GGML_ASSERT(L != nullptr && "ott2: layer without a cache");
    GGML_ASSERT(q_cur->ne[0] == L->op.D && k_cur->ne[0] == L->op.D && v_cur->ne[0] == L->op.D);
    GGML_ASSERT(k_cur->ne[1] == L->op.H && q_cur->ne[1] == L->op.n_head);
    // the ops read contiguous F32 rows: convert or copy only when needed (no extra node per layer otherwise)
    auto f32_rows = [ctx0](ggml_tensor * t) {
        t = t->type == GGML_TYPE_F32 ? t : ggml_cast(ctx0, t, GGML_TYPE_F32);
        return ggml_is_contiguous(t) ? t : ggml_cont(ctx0, t);
    };
    ggml_tensor * q = f32_rows(q_cur);
    ggml_tensor * k = f32_rows(k_cur);
    ggml_tensor * v = f32_rows(v_cur);
    const int64_t n_tok = q->ne[2] / inp->ub_plan->ne[1];
    ggml_ott_params op = L->op;
    op.scale = kq_scale;
    op.NS = ggml_ott_attn_slices(L->ring->buffer, n_tok, op.NG); // slices of the sealed groups (ggml-ott.h)
    ggml_tensor * part = ggml_ott_attn_part(ctx0, q, k, v, L->ring, L->sealed_k, L->sealed_v, L->pool_kv, L->pool_meta,
                                            inp->ub_plan, &op);
    ggml_format_name(part, "ott_attn_part-%d", il);
    ggml_tensor * out = ggml_ott_attn(ctx0, part, q->ne[2], &op);
    ggml_format_name(out, "ott_attn-%d", il);
    // the seal reads the cache after this layer's attention (`out` orders it)
    ggml_tensor * seal = ggml_ott_seal(ctx0, out, k, v, L->ring, L->sealed_k, L->sealed_v, L->pool_kv, L->pool_meta,
                                       inp->ub_plan, L->flags, &op);
    ggml_format_name(seal, "ott_seal-%d", il);
    ggml_build_forward_expand(gf, out);
    ggml_build_forward_expand(gf, seal);
    return ggml_reshape_2d(ctx0, out, out->ne[0]*out->ne[1], out->ne[2]);
}

// ------------------------------------------------------------------------------ sliding-window composite

llama_kv_cache_ott_iswa::llama_kv_cache_ott_iswa(const llama_model & model, const llama_hparams & hparams,
                                                 const llama_cparams & cparams, const llama_ott_params & p) {
    kv_ott = std::make_unique<llama_kv_cache_ott>(model, hparams, cparams, p,
                                                  [&](int32_t il) { return !hparams.is_swa(il); });
    // the window layers: what llama_kv_cache_iswa gives them (window + one ubatch, padded to 256), in f16
    const uint32_t n_seq = cparams.n_seq_max;
    const uint32_t size_swa = GGML_PAD(std::min(cparams.n_ctx_seq,
                                                hparams.n_swa*(cparams.kv_unified ? n_seq : 1) + cparams.n_ubatch), 256);
    LLAMA_LOG_INFO("%s: ott2 on the full-attention layers; window layers in an f16 cache of %u cells\n", __func__,
                   size_swa);
    kv_swa = std::make_unique<llama_kv_cache>(model, hparams, GGML_TYPE_F16, GGML_TYPE_F16, !cparams.flash_attn,
                                              cparams.offload_kqv, cparams.kv_unified, size_swa, n_seq, 1,
                                              hparams.n_swa, hparams.swa_type, nullptr,
                                              [&](int32_t il) { return hparams.is_swa(il); }, nullptr, nullptr,
                                              "_swa");
}

llama_memory_context_ptr llama_kv_cache_ott_iswa::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch,
                                                             bool embd_all) {
    GGML_UNUSED(embd_all);
    std::vector<llama_ubatch> ubatches;
    std::vector<std::vector<llama_ott_stream_plan>> plans;
    kv_ott->read_flags();
    if (!kv_ott->plan_batch(balloc, n_ubatch, ubatches, plans)) {
        return std::make_unique<llama_kv_cache_ott_iswa_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }
    auto sinfos = kv_swa->prepare(ubatches);
    if (sinfos.empty()) {
        LLAMA_LOG_ERROR("%s: ott2: the window layers' f16 cache has no room for the batch\n", __func__);
        return std::make_unique<llama_kv_cache_ott_iswa_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }
    auto ctx_swa = std::make_unique<llama_kv_cache_context>(kv_swa.get(), std::move(sinfos), ubatches);
    auto ctx_ott = std::make_unique<llama_kv_cache_ott_context>(kv_ott.get(), std::move(ubatches), std::move(plans));
    return std::make_unique<llama_kv_cache_ott_iswa_context>(std::move(ctx_ott), std::move(ctx_swa));
}

llama_memory_context_ptr llama_kv_cache_ott_iswa::init_full() {
    return std::make_unique<llama_kv_cache_ott_iswa_context>(kv_ott->init_full(), kv_swa->init_full());
}

llama_memory_context_ptr llama_kv_cache_ott_iswa::init_update(llama_context * lctx, bool optimize) {
    return kv_swa->init_update(lctx, optimize); // only the f16 window cache has anything to update
}

void llama_kv_cache_ott_iswa::clear(bool data) {
    kv_ott->clear(data);
    kv_swa->clear(data);
}

bool llama_kv_cache_ott_iswa::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    const bool ok_ott = kv_ott->seq_rm(seq_id, p0, p1);
    const bool ok_swa = kv_swa->seq_rm(seq_id, p0, p1);
    return ok_ott && ok_swa;
}

void llama_kv_cache_ott_iswa::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    kv_ott->seq_cp(seq_id_src, seq_id_dst, p0, p1);
    kv_swa->seq_cp(seq_id_src, seq_id_dst, p0, p1);
}

void llama_kv_cache_ott_iswa::seq_keep(llama_seq_id seq_id) {
    kv_ott->seq_keep(seq_id);
    kv_swa->seq_keep(seq_id);
}

void llama_kv_cache_ott_iswa::seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    kv_ott->seq_add(seq_id, p0, p1, shift);
}

void llama_kv_cache_ott_iswa::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    kv_ott->seq_div(seq_id, p0, p1, d);
}

// as llama_kv_cache_iswa: the window cache tells where a sequence can still be cut
llama_pos llama_kv_cache_ott_iswa::seq_pos_min(llama_seq_id seq_id) const {
    return kv_swa->seq_pos_min(seq_id);
}

llama_pos llama_kv_cache_ott_iswa::seq_pos_max(llama_seq_id seq_id) const {
    return kv_swa->seq_pos_max(seq_id);
}

std::map<ggml_backend_buffer_type_t, size_t> llama_kv_cache_ott_iswa::memory_breakdown() const {
    auto mb = kv_ott->memory_breakdown();
    for (const auto & [buft, size] : kv_swa->memory_breakdown()) {
        mb[buft] += size;
    }
    return mb;
}

// the ott2 part, then the window part; PARTIAL_ONLY (server checkpoints) keeps only the window part, as
// llama_kv_cache_iswa does with its base cache
void llama_kv_cache_ott_iswa::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    if ((flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == 0) {
        kv_ott->state_write(io, seq_id, flags);
    }
    kv_swa->state_write(io, seq_id, flags);
}

void llama_kv_cache_ott_iswa::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    if ((flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == 0) {
        kv_ott->state_read(io, seq_id, flags);
    }
    kv_swa->state_read(io, seq_id, flags);
}

llama_kv_cache_ott_iswa_context::llama_kv_cache_ott_iswa_context(llama_memory_status status) : status(status) {}

llama_kv_cache_ott_iswa_context::llama_kv_cache_ott_iswa_context(llama_memory_context_ptr ctx_ott,
                                                                 llama_memory_context_ptr ctx_swa) :
    status(llama_memory_status_combine(ctx_ott->get_status(), ctx_swa->get_status())),
    ctx_ott(std::move(ctx_ott)), ctx_swa(std::move(ctx_swa)) {}

bool llama_kv_cache_ott_iswa_context::next() {
    ctx_swa->next();
    return ctx_ott->next();
}

bool llama_kv_cache_ott_iswa_context::apply() {
    bool ok = ctx_ott->apply();
    ok = ctx_swa->apply() && ok;
    return ok;
}

const llama_ubatch & llama_kv_cache_ott_iswa_context::get_ubatch() const {
    return ctx_ott->get_ubatch();
}

llama_memory_status llama_kv_cache_ott_iswa_context::get_status() const {
    return status;
}

const llama_kv_cache_ott_context * llama_kv_cache_ott_iswa_context::get_ott() const {
    return static_cast<const llama_kv_cache_ott_context *>(ctx_ott.get());
}

const llama_kv_cache_context * llama_kv_cache_ott_iswa_context::get_swa() const {
    return static_cast<const llama_kv_cache_context *>(ctx_swa.get());
}

llm_graph_input_attn_kv_ott_iswa::llm_graph_input_attn_kv_ott_iswa(const llama_hparams & hparams,
        const llama_cparams & cparams, const llama_kv_cache_ott_iswa_context * mctx_oi) :
    llm_graph_input_attn_kv_iswa(hparams, cparams, nullptr), ott(hparams, cparams, mctx_oi->get_ott()),
    mctx_oi(mctx_oi) {}

void llm_graph_input_attn_kv_ott_iswa::set_input(const llama_ubatch * ubatch) {
    const llama_kv_cache_context * swa = mctx_oi->get_swa();
    if (self_k_idxs_swa && self_k_idxs_swa->buffer) {
        swa->set_input_k_idxs(self_k_idxs_swa, ubatch);
        swa->set_input_v_idxs(self_v_idxs_swa, ubatch);
    }
    if (self_kq_mask_swa && self_kq_mask_swa->buffer) {
        swa->set_input_kq_mask(self_kq_mask_swa, ubatch, cparams.causal_attn);
    }
    ott.set_input(ubatch);
}

bool llm_graph_input_attn_kv_ott_iswa::can_reuse(const llm_graph_params & params) {
    GGML_UNUSED(params);
    return false; // the window cache's mask changes shape as it fills: rebuilt each time
}

std::unique_ptr<llm_graph_input_attn_kv_iswa> llama_ott_build_input_iswa(ggml_context * ctx0,
        const llama_ubatch & ubatch, const llama_hparams & hparams, const llama_cparams & cparams,
        const llama_kv_cache_ott_iswa_context * mctx) {
    auto inp = std::make_unique<llm_graph_input_attn_kv_ott_iswa>(hparams, cparams, mctx);
    const llama_kv_cache_context * swa = mctx->get_swa();
    inp->self_k_idxs_swa = swa->build_input_k_idxs(ctx0, ubatch);
    inp->self_v_idxs_swa = swa->build_input_v_idxs(ctx0, ubatch);
    // the mask as llama-graph.cpp builds it for a stock cache: [n_kv, n_tokens/n_stream, 1, n_stream]
    const int64_t n_stream = cparams.kv_unified ? 1 : ubatch.n_seqs_unq;
    inp->self_kq_mask_swa = ggml_new_tensor_4d(ctx0, cparams.flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32,
                                               swa->get_n_kv(), ubatch.n_tokens/n_stream, 1, n_stream);
    ggml_set_input(inp->self_kq_mask_swa);
    ggml_set_name(inp->self_kq_mask_swa, "attn_inp_kq_mask_swa");
    inp->self_kq_mask_swa_cnv = inp->self_kq_mask_swa;
    // the ott2 plan, as for a model without windows
    int64_t ns = (int64_t) mctx->get_ott()->get_plan().size();
    if (ns == 0) {
        ns = std::max<int64_t>(1, ubatch.n_seqs_unq);
    }
    inp->ott.n_tokens = ubatch.n_tokens;
    inp->ott.ub_plan = ggml_new_tensor_2d(ctx0, GGML_TYPE_I32, 4, ns);
    ggml_set_input(inp->ott.ub_plan);
    return inp;
}

const llama_kv_cache_context * llama_ott_iswa_swa_context(const llm_graph_input_attn_kv_iswa * inp) {
    const auto * oi = dynamic_cast<const llm_graph_input_attn_kv_ott_iswa *>(inp);
    return oi ? oi->mctx_oi->get_swa() : nullptr;
}

// ------------------------------------------------------------------------------------------------- C API

void llama_ott_set_params(int32_t G, int32_t R, int32_t outlier_num, int32_t aux_cap, int32_t no_outlier_layers) {
    llama_ott_params & p = llama_ott_default_params();
    p.G = (uint32_t) G;
    p.R = (uint32_t) R;
    p.outlier_num = (uint32_t) outlier_num;
    p.aux_cap = (uint32_t) aux_cap;
    p.no_outlier_layers = (uint32_t) no_outlier_layers;
}

void llama_ott_get_params(int32_t * out) {
    const llama_ott_params & p = llama_ott_default_params();
    out[0] = (int32_t) p.G;
    out[1] = (int32_t) p.R;
    out[2] = (int32_t) p.outlier_num;
    out[3] = (int32_t) p.aux_cap;
    out[4] = (int32_t) p.no_outlier_layers;
}

int32_t llama_ott_cache_info(const struct llama_context * lctx, int64_t * out, int32_t n) {
    auto * kv = dynamic_cast<llama_kv_cache_ott *>(llama_get_memory(lctx));
    int64_t window = 0;
    if (auto * oi = dynamic_cast<llama_kv_cache_ott_iswa *>(llama_get_memory(lctx))) {
        kv = oi->kv_ott.get();
        for (const auto & [buft, size] : oi->kv_swa->memory_breakdown()) {
            window += (int64_t) size;
        }
    }
    if (!kv) {
        return 0;
    }
    int64_t vals[9] = { 0 };
    for (const auto & st : kv->streams) {
        vals[0] += st.n_pos;
        vals[1] += (int64_t) st.n_sealed*kv->p.G;
    }
    kv->bytes(vals[2], vals[3], vals[4]);
    kv->slots_in_use(vals[5], vals[6]);
    vals[7] = window;
    vals[8] = (int64_t) kv->n_layers();
    const int32_t m = std::min<int32_t>(n, 9);
    for (int32_t i = 0; i < m; ++i) {
        out[i] = vals[i];
    }
    return m;
}
