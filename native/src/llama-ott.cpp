// ott-gguf inside libllama: the K/V type table, the per-context configuration, model support, create_memory's
// hook and the C API of llama-ott.h.
#include "llama-kv-cache-ott.h"
#include "llama-kv-cache.h"

#include "llama-arch.h"
#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#ifndef OTT_GGUF_VERSION
#define OTT_GGUF_VERSION "unknown"
#endif

// ------------------------------------------------------------------------------------------- K/V types

// Each row is a cache type of `-ctk/-ctv` and of llama_context_params.type_k/type_v, for one side: the build has
// kernels for every pair of these widths (ott_head_find).
static const llama_ott_kv_type ott_kv_types[] = {
    { GGML_TYPE_OTT2,  "ott2",  2, true  },
    { GGML_TYPE_OTT3,  "ott3",  3, true  },
    { GGML_TYPE_OTT4,  "ott4",  4, true  },
    { GGML_TYPE_KIVI2, "kivi2", 2, false },
    { GGML_TYPE_KIVI3, "kivi3", 3, false },
    { GGML_TYPE_KIVI4, "kivi4", 4, false },
};

const llama_ott_kv_type * llama_ott_kv_type_of(ggml_type type) {
    for (const auto & t : ott_kv_types) {
        if (t.type == type) {
            return &t;
        }
    }
    return nullptr;
}

int32_t llama_ott_kv_types(enum ggml_type * out, int32_t n) {
    const int32_t count = (int32_t) (sizeof(ott_kv_types) / sizeof(ott_kv_types[0]));
    for (int32_t i = 0; out && i < count && i < n; ++i) {
        out[i] = ott_kv_types[i].type;
    }
    return count;
}

// ---------------------------------------------------------------------------------------- configuration

llama_ott_config llama_ott_config_default(void) {
    llama_ott_config c = {};
    c.G = 128;
    c.R = 32;
    c.outlier_num = 3;
    c.aux_cap = 32;
    c.no_outlier_layers = 2;
    c.v_rotate = 1;
    c.k_mix = 2; // 2- and 3-bit keys mix widths per channel: docs/long-context-keys.md
    c.v_sym = 0; // docs/v-blocks.md; layer_widths all 0: every layer takes the widths of the K/V types
    c.k_young = 0;
    c.v_young = 0;
    return c;
}

static bool ott_width_ok(int bits) {
    return bits >= 2 && bits <= 4;
}

bool llama_ott_config_set_layer_widths(struct llama_ott_config * cfg, const char * spec, char * reason, size_t n) {
    std::string why;
    uint8_t w[LLAMA_OTT_MAX_LAYERS] = {};
    for (const char * p = spec ? spec : ""; *p && why.empty();) {
        int first = -1, last = -1, kb = 0, vb = 0, used = 0;
        if (sscanf(p, "%d-%d:%d/%d%n", &first, &last, &kb, &vb, &used) != 4) {
            used = 0;
            if (sscanf(p, "%d:%d/%d%n", &first, &kb, &vb, &used) != 3) {
                why = std::string("cannot read \"") + p + "\": items are LAYER[-LAST]:K/V, e.g. 15-24:4/3";
                break;
            }
            last = first;
        }
        if (first < 0 || last < first || last >= LLAMA_OTT_MAX_LAYERS) {
            why = "layers " + std::to_string(first) + "-" + std::to_string(last) + " are not a range within [0, " +
                  std::to_string(LLAMA_OTT_MAX_LAYERS - 1) + "]";
        } else if (!ott_width_ok(kb) || !ott_width_ok(vb)) {
            why = "widths " + std::to_string(kb) + "/" + std::to_string(vb) + " are not K/V bits of 2, 3 or 4";
        } else {
            for (int il = first; il <= last; ++il) {
                w[il] = (uint8_t) (kb*16 + vb);
            }
        }
        p += used;
        if (*p == ',') {
            ++p;
        } else if (*p && why.empty()) {
            why = std::string("unexpected \"") + p + "\" (items are separated by commas)";
        }
    }
    if (reason && n > 0) {
        snprintf(reason, n, "%s", why.c_str());
    }
    if (why.empty()) {
        memcpy(cfg->layer_widths, w, sizeof(w));
    }
    return why.empty();
}

// Upper bounds keep a typo from allocating gigabytes: the tail holds R + G tokens per (layer, head, sequence),
// the pools outlier_num + aux_cap; the kernels keep the outlier candidates of a group on the stack (64).
static const int32_t OTT_MAX_R = 8192, OTT_MAX_OUTLIERS = 64, OTT_MAX_AUX = 4096, OTT_MAX_YOUNG = 16;

std::string llama_ott_config_problem(const llama_ott_config & c) {
    if (c.G != OTT2_HEAD_G) {
        return "G must be " + std::to_string(OTT2_HEAD_G) + " in this build (its kernels are generated for it), got " +
               std::to_string(c.G);
    }
    if (c.R < 0 || c.R > OTT_MAX_R) {
        return "R=" + std::to_string(c.R) + " is outside [0, " + std::to_string(OTT_MAX_R) + "]";
    }
    if (c.outlier_num < 0 || c.outlier_num > OTT_MAX_OUTLIERS) {
        return "outlier_num=" + std::to_string(c.outlier_num) + " is outside [0, " +
               std::to_string(OTT_MAX_OUTLIERS) + "]";
    }
    if (c.aux_cap < 0 || c.aux_cap > OTT_MAX_AUX) {
        return "aux_cap=" + std::to_string(c.aux_cap) + " is outside [0, " + std::to_string(OTT_MAX_AUX) + "]";
    }
    if (c.no_outlier_layers < 0) {
        return "no_outlier_layers=" + std::to_string(c.no_outlier_layers) + " is negative";
    }
    if (c.v_rotate != 0 && c.v_rotate != 1) {
        return "v_rotate=" + std::to_string(c.v_rotate) + " must be 0 or 1";
    }
    if (c.k_mix < 0 || c.k_mix > 2) {
        return "k_mix=" + std::to_string(c.k_mix) + " must be 0, 1 (3-bit keys) or 2 (2- and 3-bit keys)";
    }
    if (c.v_sym != 0 && c.v_sym != 1) {
        return "v_sym=" + std::to_string(c.v_sym) + " must be 0 or 1";
    }
    if (c.v_sym && !c.v_rotate) {
        return "v_sym=1 needs v_rotate=1 (symmetric blocks suit rotated values, which are centred)";
    }
    if (c.k_young < 0 || c.k_young > OTT_MAX_YOUNG) {
        return "k_young=" + std::to_string(c.k_young) + " is outside [0, " + std::to_string(OTT_MAX_YOUNG) + "]";
    }
    if (c.v_young < 0 || c.v_young > OTT_MAX_YOUNG) {
        return "v_young=" + std::to_string(c.v_young) + " is outside [0, " + std::to_string(OTT_MAX_YOUNG) + "]";
    }
    for (int il = 0; il < LLAMA_OTT_MAX_LAYERS; ++il) {
        const int w = c.layer_widths[il];
        if (w != 0 && (!ott_width_ok(w >> 4) || !ott_width_ok(w & 15))) {
            char hex[8];
            snprintf(hex, sizeof(hex), "0x%02x", w);
            return "layer_widths[" + std::to_string(il) + "]=" + hex +
                   " is not K bits * 16 + V bits with widths of 2, 3 or 4";
        }
    }
    return "";
}

std::string llama_ott_config_problem_ctx(const llama_ott_config & c, uint32_t n_ctx_seq) {
    const int64_t n = n_ctx_seq;
    if (c.R > n) {
        return "R=" + std::to_string(c.R) + " is larger than the context of a sequence (" + std::to_string(n) +
               " tokens): its fp16 ring would hold R+G=" + std::to_string(c.R + c.G) +
               " tokens per sequence; R must be at most " + std::to_string(n);
    }
    // the pools hold sealed tokens only, so slots beyond what a sequence can seal stay empty (one group's worth
    // is always allowed, which takes the defaults at any context)
    const int64_t sealable = (int64_t) c.G*std::max<int64_t>(1, (n - c.R)/c.G);
    if ((int64_t) c.outlier_num + c.aux_cap > sealable) {
        return "outlier_num + aux_cap = " + std::to_string(c.outlier_num + c.aux_cap) + " pool slots exceed the " +
               std::to_string(sealable) + " tokens a sequence of " + std::to_string(n) + " tokens can seal (G=" +
               std::to_string(c.G) + ", R=" + std::to_string(c.R) + "); they must be at most " +
               std::to_string(sealable);
    }
    return "";
}

bool llama_ott_config_check(const struct llama_ott_config * cfg, char * reason, size_t n) {
    const std::string why = cfg ? llama_ott_config_problem(*cfg) : "no configuration given";
    if (reason && n > 0) {
        snprintf(reason, n, "%s", why.c_str());
    }
    return why.empty();
}

// The configuration reaches create_memory through the stock llama_init_from_model, whose signature has no room
// for it: it is set on the creating thread for the duration of the call (llama_ott_init_from_model) or by a
// binding around its own call (llama_ott_set_thread_config), so contexts created concurrently keep their own.
static thread_local bool             ott_thread_has_cfg = false;
static thread_local llama_ott_config ott_thread_cfg;

void llama_ott_set_thread_config(const struct llama_ott_config * cfg) {
    if (cfg) {
        llama_ott_record_error(""); // a context creation on this thread starts without a reason from before
    }
    ott_thread_has_cfg = cfg != nullptr;
    if (cfg) {
        ott_thread_cfg = *cfg;
    }
}

llama_context * llama_ott_init_from_model(llama_model * model, llama_context_params params,
                                          const struct llama_ott_config * cfg) {
    const bool had = ott_thread_has_cfg;
    const llama_ott_config saved = ott_thread_cfg;
    llama_ott_set_thread_config(cfg);
    llama_context * ctx = llama_init_from_model(model, params);
    ott_thread_has_cfg = had; // restored without clearing the reason of a failure
    ott_thread_cfg = saved;
    return ctx;
}

// ---------------------------------------------------------------------------------------- model support

std::string llama_ott_model_problem(const llama_model & model) {
    const llama_hparams & hparams = model.hparams;
    const std::string arch = llm_arch_name(model.arch);
    if (llm_arch_is_recurrent(model.arch) || llm_arch_is_hybrid(model.arch)) {
        return "the " + arch + " architecture keeps a recurrent state; the ott caches support attention-only models";
    }
    if (hparams.is_mla()) {
        return "the " + arch + " architecture uses MLA (compressed latent K/V), which the ott caches do not support";
    }
    if (hparams.is_swa_any() && hparams.swa_type != LLAMA_SWA_TYPE_STANDARD) {
        return "the " + arch + " architecture uses a non-standard sliding window, which the ott caches do not "
               "support";
    }
    if (hparams.attn_soft_cap) {
        return "the " + arch + " architecture soft-caps attention scores, which the ott attention does not do";
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

static llama_memory_i * ott_create_memory(const llama_model & model, const llama_cparams & cparams, ggml_type type_k,
                                          ggml_type type_v) {
    const llama_ott_kv_type * tk = llama_ott_kv_type_of(type_k);
    const llama_ott_kv_type * tv = llama_ott_kv_type_of(type_v);
    if (!tk && !tv) {
        return nullptr;
    }
    if (!tk || !tv || tk->outliers != tv->outliers) {
        std::string ott, kivi;
        for (const auto & t : ott_kv_types) {
            std::string & list = t.outliers ? ott : kivi;
            list += std::string(list.empty() ? "" : ", ") + t.name;
        }
        throw std::runtime_error(std::string("ott: K and V must both be ott types (") + ott + ") or both kivi types (" +
                                 kivi + "), in any widths; got K " + ggml_type_name(type_k) + " and V " +
                                 ggml_type_name(type_v));
    }
    llama_ott_kv_pair pair = {};
    snprintf(pair.name, sizeof(pair.name), tk == tv ? "%s" : "%s/%s", tk->name, tv->name);
    pair.kbits = tk->bits;
    pair.vbits = tv->bits;
    pair.outliers = tk->outliers;
    const std::string why = llama_ott_model_problem(model);
    if (!why.empty()) {
        throw std::runtime_error(std::string(pair.name) + ": " + why);
    }
    const llama_ott_config cfg = ott_thread_has_cfg ? ott_thread_cfg : llama_ott_config_default();
    const std::string bad = llama_ott_config_problem(cfg);
    if (!bad.empty()) {
        throw std::runtime_error(std::string(pair.name) + ": " + bad);
    }
    if (!ott_head_find(pair.kbits, pair.vbits, llama_ott_k_mixed(cfg, pair.kbits), cfg.v_sym && pair.vbits == 2)) {
        throw std::runtime_error(std::string(pair.name) + ": this build has no kernels for " +
                                 std::to_string(pair.kbits) + "-bit keys with " + std::to_string(pair.vbits) +
                                 "-bit values");
    }
    const llama_hparams & hparams = model.hparams;
    if (cparams.kv_unified && cparams.n_seq_max > 1) {
        if (hparams.is_swa_any()) {
            throw std::runtime_error(std::string(pair.name) + ": several sequences of a sliding-window model need "
                                     "separate K/V streams: turn the unified KV cache off (llama-server "
                                     "--no-kv-unified, kv_unified=false)");
        }
        LLAMA_LOG_INFO("%s: %s keeps one stream per sequence: the unified KV cache is not used\n", __func__, pair.name);
    }
    if (hparams.is_swa_any()) {
        return new llama_kv_cache_ott_iswa(model, cparams, pair, cfg);
    }
    return new llama_kv_cache_ott(model, cparams, pair, cfg);
}

llama_memory_i * llama_ott_create_memory(const llama_model & model, const llama_cparams & cparams, ggml_type type_k,
                                         ggml_type type_v) {
    try {
        return ott_create_memory(model, cparams, type_k, type_v);
    } catch (const std::exception & e) {
        // llama_init_from_model only logs it and returns NULL: keep the reason for llama_ott_last_error
        llama_ott_record_error(e.what());
        throw;
    }
}

// ------------------------------------------------------------------------------------------------ C API

static thread_local std::string ott_last_error;

void llama_ott_record_error(const std::string & msg) {
    ott_last_error = msg;
}

const char * llama_ott_last_error(void) {
    return ott_last_error.c_str();
}

const char * llama_ott_build_info(void) {
    static const std::string info = [] {
        char buf[256];
        snprintf(buf, sizeof(buf), "ott-gguf %s; ott caches: K and V codes of 2, 3 or 4 bits, G=%d, Gv=%d; kernels %s",
                 OTT_GGUF_VERSION, OTT2_HEAD_G, OTT2_HEAD_GV, ott2_head_isa());
        return std::string(buf);
    }();
    return info.c_str();
}

bool llama_ott_supports_model(const struct llama_model * model, char * reason, size_t n) {
    const std::string why = llama_ott_model_problem(*model);
    if (reason && n > 0) {
        snprintf(reason, n, "%s", why.c_str());
    }
    return why.empty();
}

// the context's ott cache (the ott part of a sliding-window composite), or nullptr
static llama_kv_cache_ott * ott_cache_of(const llama_context * lctx, int64_t * window_bytes) {
    llama_memory_i * mem = llama_get_memory(lctx);
    if (auto * oi = dynamic_cast<llama_kv_cache_ott_iswa *>(mem)) {
        if (window_bytes) {
            for (const auto & [buft, size] : oi->kv_swa->memory_breakdown()) {
                *window_bytes += (int64_t) size;
            }
        }
        return oi->kv_ott.get();
    }
    return dynamic_cast<llama_kv_cache_ott *>(mem);
}

int64_t llama_ott_kv_cache_bytes(const struct llama_context * lctx) {
    const llama_memory_i * mem = llama_get_memory(lctx);
    int64_t total = 0;
    if (mem) {
        for (const auto & [buft, size] : mem->memory_breakdown()) {
            total += (int64_t) size;
        }
    }
    return total;
}

bool llama_ott_context_config(const struct llama_context * lctx, struct llama_ott_config * out) {
    const llama_kv_cache_ott * kv = ott_cache_of(lctx, nullptr);
    if (kv && out) {
        *out = kv->cfg;
    }
    return kv != nullptr;
}

bool llama_ott_seq_can_cut(const struct llama_context * lctx, llama_seq_id seq_id, llama_pos p0) {
    const llama_kv_cache_ott * kv = ott_cache_of(lctx, nullptr);
    return !kv || kv->seq_can_cut(seq_id, p0);
}

int32_t llama_ott_cache_info(const struct llama_context * lctx, int64_t * out, int32_t n) {
    int64_t vals[9] = { 0 };
    const llama_kv_cache_ott * kv = ott_cache_of(lctx, &vals[7]);
    if (!kv) {
        return 0;
    }
    for (const auto & st : kv->streams) {
        vals[0] += st.n_pos;
        vals[1] += (int64_t) st.n_sealed*kv->cfg.G;
    }
    vals[2] = (int64_t) kv->bytes_quant;
    vals[3] = (int64_t) kv->bytes_tail;
    vals[4] = (int64_t) kv->bytes_pool;
    kv->slots_in_use(vals[5], vals[6]);
    vals[8] = (int64_t) kv->n_layers();
    const int32_t m = std::min<int32_t>(n, 9);
    for (int32_t i = 0; i < m; ++i) {
        out[i] = vals[i];
    }
    return m;
}

int32_t llama_ott_cache_layers(const struct llama_context * lctx, int32_t * out, int32_t n) {
    const llama_kv_cache_ott * kv = ott_cache_of(lctx, nullptr);
    if (!kv) {
        return 0;
    }
    for (size_t i = 0; out && i < kv->n_layers() && (int32_t) i < n; ++i) {
        out[i] = kv->layer_il(i);
    }
    return (int32_t) kv->n_layers();
}
