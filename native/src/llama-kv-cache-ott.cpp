// The ott cache: allocation, batch planning and the memory context (see llama-kv-cache-ott.h).
#include "llama-kv-cache-ott.h"

#include "llama-cparams.h"
#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-rpc.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

// ------------------------------------------------------------------------------------------- construction

// a kivi type's cache has no outliers, whatever the configuration says: resolved here, once
static llama_ott_config ott_effective_config(const llama_ott_kv_pair & kv_type, llama_ott_config cfg) {
    if (!kv_type.outliers) {
        cfg.outlier_num = 0;
    }
    return cfg;
}

// An RPC device runs the graphs it is sent with the ggml of its server, which reads ops by id: only a server built
// from this project's ggml knows the ott ops, and says so by its protocol patch version (patch 0004). A stock one of
// the pinned version would abort on them, another version would run other ops under their ids: refuse it here,
// before any graph, naming the host.
static void ott_check_rpc_device(const char * type_name, uint32_t il, ggml_backend_dev_t dev) {
    using get_version_t = void (*)(const char *, int *, int *, int *);
    auto get_version = (get_version_t) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev),
                                                                         "ggml_backend_rpc_get_server_version");
    const char * endpoint = ggml_backend_dev_description(dev);
    int major = -1, minor = -1, patch = -1;
    if (get_version) {
        get_version(endpoint, &major, &minor, &patch);
    }
    if (major != RPC_PROTO_MAJOR_VERSION || patch != RPC_PROTO_PATCH_VERSION) {
        throw std::runtime_error(std::string(type_name) + ": layer " + std::to_string(il) + " is offloaded to " +
                                 ggml_backend_dev_name(dev) + " at " + endpoint + ", whose rpc-server has no ott ops " +
                                 "(it answers protocol " + std::to_string(major) + "." + std::to_string(minor) + "." +
                                 std::to_string(patch) + ", ott-gguf's ggml-rpc-server " +
                                 std::to_string(RPC_PROTO_MAJOR_VERSION) + "." + std::to_string(RPC_PROTO_MINOR_VERSION) +
                                 "." + std::to_string(RPC_PROTO_PATCH_VERSION) + "): run ott-gguf's ggml-rpc-server " +
                                 "(ott_gguf/bin) on " + endpoint + ", or keep the K/V cache on this host (no_kv_offload / -nkvo)");
    }
}

// A device that does not run one of a layer's ott ops (its kernels do not cover the head config, or it lacks a
// feature they need) would have the scheduler run that op elsewhere on a copy of the state, which the seal then
// writes: refuse the cache instead, naming the layer and the device. Asked with the layer's own state tensors.
static void ott_check_device_ops(const char * type_name, const ott_layer & L, ggml_backend_dev_t dev) {
    ggml_init_params ip = { 8*ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    const ggml_ott_params & p = L.op;
    ggml_tensor * q    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, p.D, p.n_head, 1);
    ggml_tensor * k    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, p.D, p.H, 1);
    ggml_tensor * v    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, p.D, p.H, 1);
    ggml_tensor * plan = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 4, 1);
    ggml_tensor * part = ggml_ott_attn_part(ctx, q, k, v, L.ring, L.sealed_k, L.sealed_v, L.pool_kv, L.pool_meta, plan, &p);
    ggml_tensor * out  = ggml_ott_attn(ctx, part, 1, L.flags, &p);
    ggml_tensor * seal = ggml_ott_seal(ctx, out, k, v, L.ring, L.sealed_k, L.sealed_v, L.pool_kv, L.pool_meta, plan,
                                       L.flags, &p);
    const char * refused = !ggml_backend_dev_supports_op(dev, part) ? "attention" :
                           !ggml_backend_dev_supports_op(dev, out)  ? "merge" :
                           !ggml_backend_dev_supports_op(dev, seal) ? "seal" : nullptr;
    ggml_free(ctx);
    if (refused) {
        throw std::runtime_error(std::string(type_name) + ": layer " + std::to_string(L.il) + " is offloaded to " +
                                 ggml_backend_dev_name(dev) + " (" + ggml_backend_dev_description(dev) +
                                 "), which cannot run its ott " + refused + " (K " + std::to_string(p.kbits) +
                                 " bits, V " + std::to_string(p.vbits) + " bits, head dim " + std::to_string(p.D) +
                                 "; the Vulkan kernels need 8- and 16-bit storage buffers, the attention also subgroup shuffles and a "
                                 "required subgroup size of at most 32, and fp64): keep "
                                 "the K/V cache on the CPU (no_kv_offload / -nkvo)");
    }
}

llama_kv_cache_ott::llama_kv_cache_ott(const llama_model & model, const llama_cparams & cparams,
                                       const llama_ott_kv_pair & kv_type, const llama_ott_config & cfg_in,
                                       const layer_filter_cb & filter) :
    kv_type(kv_type), hk(ott_head_find(kv_type.kbits, kv_type.vbits, 0, 0)), cfg(ott_effective_config(kv_type, cfg_in)),
    n_stream(cparams.n_seq_max),
    // one stream per sequence: a unified context of n_ctx is shared out, not given to each sequence
    n_ctx_seq(cparams.kv_unified && cparams.n_seq_max > 1 ? cparams.n_ctx / cparams.n_seq_max : cparams.n_ctx_seq) {
    GGML_ASSERT(hk && cfg.G == hk->G);
    // here, where the context of a sequence is known (Python, llama-server and llama-cli all pass through)
    const std::string bad = llama_ott_config_problem_ctx(cfg, n_ctx_seq);
    if (!bad.empty()) {
        throw std::runtime_error(std::string(kv_type.name) + ": " + bad);
    }
    const llama_hparams & hparams = model.hparams;
    const uint32_t n_layer = hparams.n_layer();
    const int32_t G = cfg.G, Gv = hk->Gv, T = cfg.R + cfg.G;
    const int32_t S = std::max<int32_t>(1, cfg.outlier_num + cfg.aux_cap);
    // a group is sealed once R newer tokens follow it, so n_ctx_seq positions seal at most (n_ctx_seq - R) / G
    // groups; the rest stay in the ring (at least one group's room so that tensors are never empty)
    const int32_t NG = std::max<int32_t>(1, ((int32_t) n_ctx_seq - cfg.R) / G);

    // a refusal below throws out of the constructor, where the destructor does not run: free what was made so far
    // (a caller that retries with the cache on the CPU gets its device memory back)
    struct release_on_throw {
        llama_kv_cache_ott * cache;
        ~release_on_throw() {
            if (cache) {
                cache->release();
            }
        }
    } guard{this};

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
            throw std::runtime_error(std::string(kv_type.name) + ": failed to create the ggml context");
        }
        ctx_of[buft] = c;
        ctxs.push_back(c);
        ggml_tensor * f = ggml_new_tensor_1d(c, GGML_TYPE_I32, n_stream);
        ggml_format_name(f, "ott_flags_%zu", flags.size());
        flags.push_back(f);
        bytes_pool += ggml_nbytes(f);
        return c;
    };
    for (int32_t il = (int32_t) n_layer; il < LLAMA_OTT_MAX_LAYERS; ++il) {
        if (cfg.layer_widths[il]) {
            throw std::runtime_error(std::string(kv_type.name) + ": the configuration gives widths to layer " +
                                     std::to_string(il) + ", but the model has " + std::to_string(n_layer) +
                                     " layers (0.." + std::to_string(n_layer - 1) + ")");
        }
    }
    layer_ids.assign(n_layer, -1);
    for (uint32_t il = 0; il < n_layer; ++il) {
        if (filter && !filter((int32_t) il)) {
            if (il < LLAMA_OTT_MAX_LAYERS && cfg.layer_widths[il]) {
                throw std::runtime_error(std::string(kv_type.name) + ": the configuration gives widths to layer " +
                                         std::to_string(il) + ", which this cache does not serve (a sliding-window "
                                         "layer keeps an f16 cache)");
            }
            continue;
        }
        ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
        if (cparams.offload_kqv) {
            ggml_backend_dev_t dev = model.dev_layer(il);
            const std::string reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
            if (reg == "RPC") {
                // the cache lives in the remote's buffer and the ops run there, on the server's backend
                ott_check_rpc_device(kv_type.name, il, dev);
            } else if (reg != "CPU" && reg != "CUDA" && reg != "Vulkan") {
                // the ops exist for these backends only: refuse rather than move the cache behind the user's back
                throw std::runtime_error(std::string(kv_type.name) + ": layer " + std::to_string(il) +
                                         " is offloaded to " + reg + ", which has no ott ops (CPU, CUDA and Vulkan "
                                         "have, and RPC servers built by ott-gguf); offload to CUDA or Vulkan, or keep "
                                         "the K/V cache on the CPU (no_kv_offload / -nkvo)");
            }
            buft = ggml_backend_dev_buffer_type(dev);
        }
        ggml_context * ctx = ctx_for(buft);
        const uint32_t D = hparams.n_embd_head_k(il);
        const uint32_t H = hparams.n_head_kv(il);
        // the layer's own widths where the configuration gives them (llama_ott_config.layer_widths)
        const int32_t w = il < LLAMA_OTT_MAX_LAYERS ? cfg.layer_widths[il] : 0;
        const int32_t kbits = w ? w >> 4 : kv_type.kbits, vbits = w ? w & 15 : kv_type.vbits;
        // k_mix changes the K format of 3-bit layers (k_mix 1) and of 2-bit layers too (k_mix 2): widths kbits +- 1
        const int32_t kmix = llama_ott_k_mixed(cfg, kbits);
        // v_sym changes the V format of 2-bit layers only
        const int32_t vsym = cfg.v_sym && vbits == 2;
        const ott_head_kernels * hkl = ott_head_find(kbits, vbits, kmix, vsym);
        GGML_ASSERT(hkl && hkl->G == hk->G && hkl->Gv == hk->Gv);
        // keys and values by age (k_young, v_young): a layer with 2-bit keys (values) also holds its newest groups'
        // keys (values) at 3 bits, in a ring after the NG group slots of sealed_k (sealed_v), as many slots as the
        // ring's bytes take
        const int32_t AK = kbits == 2 ? cfg.k_young : 0, AV = vbits == 2 ? cfg.v_young : 0;
        const int32_t ymix = AK ? llama_ott_k_mixed(cfg, kbits + 1) : 0;
        const ott_head_kernels * hyk = AK ? ott_head_find(kbits + 1, vbits, ymix, vsym) : nullptr;
        const ott_head_kernels * hyv = AV ? ott_head_find(kbits, vbits + 1, kmix, 0) : nullptr;
        const ott_head_kernels * hykv = AK && AV ? ott_head_find(kbits + 1, vbits + 1, ymix, 0) : nullptr;
        if ((AK && !hyk) || (AV && !hyv) || (AK && AV && !hykv)) {
            throw std::runtime_error(std::string(kv_type.name) + ": this build has no kernels for the young keys or "
                                     "values of layer " + std::to_string(il) + " (k_young, v_young)");
        }
        if ((AK || AV) && buft != ggml_backend_cpu_buffer_type()) {
            // the young groups' kernels exist for the CPU only: refuse rather than run the ops elsewhere
            throw std::runtime_error(std::string(kv_type.name) + ": layer " + std::to_string(il) + " keeps its "
                                     "cache on " + ggml_backend_buft_name(buft) + ", but keys and values by age (k_young=" +
                                     std::to_string(cfg.k_young) + ", v_young=" + std::to_string(cfg.v_young) +
                                     ") run on the CPU only so far: keep the K/V cache on the CPU (no_kv_offload / "
                                     "-nkvo) or set them to 0");
        }
        const int64_t kbytes = (int64_t) ott_head_kbytes(hkl, (int) D), vbytes = (int64_t) G*(D/Gv)*hkl->vb;
        const int64_t ykbytes = AK ? (int64_t) ott_head_kbytes(hyk, (int) D) : 0;
        const int64_t yvbytes = AV ? (int64_t) G*(D/Gv)*hyv->vb : 0;
        const int64_t n_young_k = (AK*ykbytes + kbytes - 1)/kbytes, n_young_v = (AV*yvbytes + vbytes - 1)/vbytes;
        ott_layer L;
        L.il = il;
        L.ring      = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, H, T, 2*n_stream);
        L.sealed_k  = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, kbytes, NG + n_young_k, H, n_stream);
        L.sealed_v  = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, vbytes, NG + n_young_v, H, n_stream);
        L.pool_kv   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, S, 2, (int64_t) H*n_stream);
        L.pool_meta = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, ott_meta_row::len(S), H, n_stream);
        L.flags     = flags[std::find(ctxs.begin(), ctxs.end(), ctx) - ctxs.begin()];
        ggml_format_name(L.ring, "ott_ring_l%d", il);
        ggml_format_name(L.sealed_k, "ott_sealed_k_l%d", il);
        ggml_format_name(L.sealed_v, "ott_sealed_v_l%d", il);
        ggml_format_name(L.pool_kv, "ott_pool_kv_l%d", il);
        ggml_format_name(L.pool_meta, "ott_pool_meta_l%d", il);
        L.op = {};
        L.op.D           = (int32_t) D;
        L.op.H           = (int32_t) H;
        L.op.n_head      = (int32_t) hparams.n_head(il);
        L.op.G           = G;
        L.op.Gv          = Gv;
        L.op.T           = T;
        L.op.S           = S;
        L.op.NG          = NG;
        L.op.n_stream    = (int32_t) n_stream;
        L.op.outlier_num = (int32_t) il < cfg.no_outlier_layers ? 0 : cfg.outlier_num;
        L.op.aux_cap     = cfg.aux_cap;
        L.op.kbits       = kbits;
        L.op.vbits       = vbits;
        L.op.flags       = (cfg.v_rotate ? GGML_OTT_V_ROTATE : 0) | (kmix ? GGML_OTT_K_MIX : 0) |
                           (vsym ? GGML_OTT_V_SYM : 0) | (ymix ? GGML_OTT_K_YOUNG_MIX : 0) |
                           (AK << GGML_OTT_K_YOUNG_SHIFT) | (AV << GGML_OTT_V_YOUNG_SHIFT);
        L.young_kbytes   = (size_t) ykbytes;
        L.young_vbytes   = (size_t) yvbytes;
        L.op.NS          = 1;    // chosen per graph (llama_ott_build_attn)
        L.op.scale       = 1.0f; // the model's, per graph
        bytes_quant += ggml_nbytes(L.sealed_k) + ggml_nbytes(L.sealed_v);
        bytes_tail  += ggml_nbytes(L.ring);
        bytes_pool  += ggml_nbytes(L.pool_kv) + ggml_nbytes(L.pool_meta);
        layer_ids[il] = (int32_t) layers.size();
        layers.push_back(L);
    }
    for (auto & [buft, c] : ctx_of) {
        ggml_backend_buffer_t b = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!b) {
            throw std::runtime_error(std::string(kv_type.name) + ": failed to allocate the cache buffer (" +
                                     ggml_backend_buft_name(buft) + ")");
        }
        // weights usage: the scheduler runs an op where such a source lives, so the ops go to the cache's
        // device and the state, written in place, is never copied to another backend
        ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(b, 0);
        bufs.push_back(b);
        LLAMA_LOG_INFO("%s: %s cache on %s: %7.2f MiB\n", __func__, kv_type.name, ggml_backend_buft_name(buft),
                       ggml_backend_buffer_get_size(b)/1048576.0);
    }
    for (const auto & L : layers) {
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(L.ring->buffer));
        if (dev && std::string(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev))) == "Vulkan") {
            ott_check_device_ops(kv_type.name, L, dev);
        }
    }
    streams.assign(n_stream, {});
    poisoned.assign(n_stream, 0);
    for (uint32_t s = 0; s < n_stream; ++s) {
        reset_stream_meta(s);
    }
    LLAMA_LOG_INFO("%s: %s cache: %zu layers, %u seqs x %u ctx, K %d bits%s, V %d bits%s, G=%d R=%d Gv=%d "
                   "outliers=%d aux=%d (first %d layers none), kernels %s\n", __func__, kv_type.name, layers.size(),
                   n_stream, n_ctx_seq, kv_type.kbits, llama_ott_k_mixed(cfg, kv_type.kbits) ? " mixed" : "", kv_type.vbits,
                   cfg.v_rotate ? (cfg.v_sym && kv_type.vbits == 2 ? " rotated symmetric" : " rotated") : "", G, cfg.R, Gv,
                   cfg.outlier_num, cfg.aux_cap, cfg.no_outlier_layers, ott2_head_isa());
    std::string widths;
    for (const auto & L : layers) {
        widths += " " + std::to_string(L.op.kbits) + ((L.op.flags & GGML_OTT_K_MIX) ? "m" : "") + "/" +
                  std::to_string(L.op.vbits) + ((L.op.flags & GGML_OTT_V_SYM) ? "s" : "");
    }
    LLAMA_LOG_INFO("%s: %s cache: K/V bits by layer:%s\n", __func__, kv_type.name, widths.c_str());
    LLAMA_LOG_INFO("%s: %s cache size = %7.2f MiB: quantized %7.2f MiB, fp16 tail %7.2f MiB, pools %7.2f MiB\n",
                   __func__, kv_type.name, (bytes_quant + bytes_tail + bytes_pool)/1048576.0, bytes_quant/1048576.0,
                   bytes_tail/1048576.0, bytes_pool/1048576.0);
    guard.cache = nullptr;
}

llama_kv_cache_ott::~llama_kv_cache_ott() {
    release();
}

void llama_kv_cache_ott::release() {
    for (auto * b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (auto * c : ctxs) {
        ggml_free(c);
    }
    bufs.clear();
    ctxs.clear();
}

void llama_kv_cache_ott::reset_stream_meta(uint32_t s) {
    for (auto & L : layers) {
        std::vector<int32_t> meta((size_t) L.pool_meta->ne[0]*L.op.H, 0);
        for (int32_t h = 0; h < L.op.H; ++h) {
            ott_meta_row{ &meta[(size_t) h*L.pool_meta->ne[0]], L.op.S }.tracing() = 1;
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


void llama_kv_cache_ott::slots_in_use(int64_t & n_outlier, int64_t & n_aux) const {
    n_outlier = n_aux = 0;
    for (const auto & L : layers) {
        std::vector<int32_t> meta(ggml_nelements(L.pool_meta));
        ggml_backend_tensor_get(L.pool_meta, meta.data(), 0, ggml_nbytes(L.pool_meta));
        for (size_t i = 0; i < meta.size(); i += L.pool_meta->ne[0]) {
            const ott_meta_row row = { &meta[i], L.op.S };
            n_outlier += row.n_pool();
            n_aux     += row.n_aux();
        }
    }
}

std::map<ggml_backend_buffer_type_t, size_t> llama_kv_cache_ott::memory_breakdown() const {
    std::map<ggml_backend_buffer_type_t, size_t> out;
    for (auto * b : bufs) {
        out[ggml_backend_buffer_get_type(b)] += ggml_backend_buffer_get_size(b);
    }
    return out;
}


// ------------------------------------------------------------------------------------------------ batches

bool llama_kv_cache_ott::plan_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, std::vector<llama_ubatch> & ubatches,
                                    std::vector<std::vector<llama_ott_stream_plan>> & plans) const {
    balloc.split_reset();
    std::vector<ott_stream> sim = streams;
    // Batch invariance (docs/design-ott2-cache.md, "Batches"): a ubatch attends to its own tokens in fp16, so a run
    // of a sequence must not cross a position R + kG where one more group is sealed for the queries after it; the
    // cache cuts the ubatches there. One stream: the cap is known before the split. Several: split_equal picks
    // the sequences, so an offending split is undone (split_reset and a replay of the caps so far, deterministic)
    // and redone with runs no longer than the smallest headroom.
    std::vector<uint32_t> caps;
    auto split = [&](uint32_t cap) {
        return n_stream == 1 ? balloc.split_simple(cap) : balloc.split_equal(cap, true, 0);
    };
    while (true) {
        uint32_t cap = n_ubatch;
        if (n_stream == 1) {
            cap = std::min<uint32_t>(cap, (uint32_t) seal_headroom(sim[0].n_pos));
        }
        llama_ubatch ub = split(cap);
        if (ub.n_tokens == 0) {
            break;
        }
        if (n_stream > 1) {
            uint32_t n_runs = 0, headroom = UINT32_MAX;
            for (uint32_t i = 0; i < ub.n_tokens; ++i) {
                if (i == 0 || ub.seq_id[i][0] != ub.seq_id[i - 1][0]) {
                    const llama_seq_id s = ub.seq_id[i][0];
                    n_runs++;
                    if (s >= 0 && (uint32_t) s < n_stream) {
                        headroom = std::min<uint32_t>(headroom, (uint32_t) seal_headroom(sim[s].n_pos));
                    }
                }
            }
            if (n_runs > 0 && ub.n_tokens / n_runs > headroom) {
                cap = headroom*n_runs;
                balloc.split_reset();
                for (uint32_t c : caps) {
                    split(c);
                }
                ub = split(cap);
            }
        }
        caps.push_back(cap);
        // the ubatch is runs of tokens of one sequence each, all runs of equal length
        std::vector<llama_ott_stream_plan> plan;
        uint32_t run = 0;
        for (uint32_t i = 0; i < ub.n_tokens; ++i) {
            if (ub.n_seq_id[i] != 1) {
                LLAMA_LOG_ERROR("%s: %s: a token shared by several sequences is not supported\n", __func__, kv_type.name);
                return false;
            }
            const llama_seq_id s = ub.seq_id[i][0];
            if (s < 0 || (uint32_t) s >= n_stream) {
                LLAMA_LOG_ERROR("%s: %s: seq_id %d out of range [0, %u)\n", __func__, kv_type.name, s, n_stream);
                return false;
            }
            if (plan.empty() || plan.back().stream != s) {
                plan.push_back({ s, sim[s].n_pos, sim[s].n_sealed, 0 });
                run = 0;
            }
            if (ub.pos[i] != sim[s].n_pos + (llama_pos) run) {
                LLAMA_LOG_ERROR("%s: %s: sequence %d continues at position %d, got %d (positions must be consecutive; "
                                "remove the tail with seq_rm first)\n", __func__, kv_type.name, s, sim[s].n_pos + run, ub.pos[i]);
                return false;
            }
            run++;
            if (i + 1 == ub.n_tokens || ub.seq_id[i + 1][0] != s) {
                if (sealed_at(sim[s].n_pos + (int32_t) run - 1) != sim[s].n_sealed) {
                    LLAMA_LOG_ERROR("%s: %s: internal error: a ubatch of sequence %d crosses a seal boundary\n",
                                    __func__, kv_type.name, s);
                    return false;
                }
                if ((uint32_t) sim[s].n_pos + run > n_ctx_seq) {
                    LLAMA_LOG_ERROR("%s: %s: sequence %d would exceed its context of %u tokens\n", __func__, kv_type.name, s, n_ctx_seq);
                    return false;
                }
                sim[s].n_pos += run;
                sim[s].n_sealed = sealed_after(sim[s].n_sealed, sim[s].n_pos);
                plan.back().n_sealed_after = sim[s].n_sealed;
            }
        }
        if (ub.n_tokens % plan.size() != 0) {
            LLAMA_LOG_ERROR("%s: %s: unequal sequence runs in a ubatch\n", __func__, kv_type.name);
            return false;
        }
        for (const auto & pl : plan) {
            if (poisoned[pl.stream]) {
                LLAMA_LOG_ERROR("%s: %s: sequence %d holds non-finite keys or values (computed by an earlier batch); "
                                "its cache cannot be quantized: clear the sequence (seq_rm over all positions) and "
                                "process it again\n", __func__, kv_type.name, pl.stream);
                return false;
            }
            if (std::count_if(plan.begin(), plan.end(), [&](const auto & x) { return x.stream == pl.stream; }) != 1) {
                LLAMA_LOG_ERROR("%s: %s: a sequence appears twice in one ubatch\n", __func__, kv_type.name);
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
