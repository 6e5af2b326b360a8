// The ott cache in the graph: its inputs (the ubatch plan) and the attention hook (see llama-kv-cache-ott.h).
#include "llama-kv-cache-ott.h"
#include "llama-kv-cache.h"

#include "llama-cparams.h"

#include "ggml-backend.h"

#include <algorithm>

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

void llm_graph_input_attn_kv_ott::build(ggml_context * ctx0, const llama_ubatch & ubatch) {
    int64_t ns = (int64_t) mctx_ott->get_plan().size();
    if (ns == 0) {
        ns = std::max<int64_t>(1, ubatch.n_seqs_unq); // graph reservation
    }
    n_tokens = ubatch.n_tokens;
    ub_plan = ggml_new_tensor_2d(ctx0, GGML_TYPE_I32, 4, ns);
    ggml_set_input(ub_plan);
}

std::unique_ptr<llm_graph_input_attn_kv> llama_ott_build_input(ggml_context * ctx0, const llama_ubatch & ubatch,
        const llama_hparams & hparams, const llama_cparams & cparams, const llama_memory_context_i * mctx) {
    const auto * mctx_ott = dynamic_cast<const llama_kv_cache_ott_context *>(mctx);
    if (!mctx_ott) {
        return nullptr;
    }
    auto inp = std::make_unique<llm_graph_input_attn_kv_ott>(hparams, cparams, mctx_ott);
    inp->build(ctx0, ubatch);
    return inp;
}

// ------------------------------------------------------------------------------------------------- ops

// the layer's three ops (ggml-ott.h): attention partials, their merge, then the seal. They run where the
// layer's cache lives (CPU or CUDA): the state tensors sit in a weights-usage buffer of the layer's device,
// so the scheduler places the ops with them and never copies the state.
ggml_tensor * llama_ott_build_attn(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_input_i * inp_any,
        ggml_tensor * q_cur, ggml_tensor * k_cur, ggml_tensor * v_cur, ggml_tensor * kq_b, ggml_tensor * sinks,
        ggml_tensor * v_mla, float kq_scale, int il) {
    llm_graph_input_attn_kv_ott * inp = dynamic_cast<llm_graph_input_attn_kv_ott *>(inp_any);
    if (auto * oi = dynamic_cast<llm_graph_input_attn_kv_ott_iswa *>(inp_any)) {
        inp = &oi->ott;
    }
    if (!inp) {
        return nullptr; // a stock cache's input
    }
    llama_kv_cache_ott * kv = inp->mctx_ott->get_kv();
    ott_layer * L = kv->layer(il);
    if (!L) {
        // only a sliding-window composite leaves layers (its window layers) to its stock f16 cache
        GGML_ASSERT(inp != inp_any && "ott: layer without a cache");
        return nullptr;
    }
    GGML_ASSERT(kq_b == nullptr && sinks == nullptr && v_mla == nullptr &&
                "ott: attention biases, sinks and MLA are not supported");
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
    // the flags tell the merge that the seal below follows it (CUDA runs both in one launch)
    ggml_tensor * out = ggml_ott_attn(ctx0, part, q->ne[2], L->flags, &op);
    ggml_format_name(out, "ott_attn-%d", il);
    // the seal reads the cache after this layer's attention (`out` orders it)
    ggml_tensor * seal = ggml_ott_seal(ctx0, out, k, v, L->ring, L->sealed_k, L->sealed_v, L->pool_kv, L->pool_meta,
                                       inp->ub_plan, L->flags, &op);
    ggml_format_name(seal, "ott_seal-%d", il);
    ggml_build_forward_expand(gf, out);
    ggml_build_forward_expand(gf, seal);
    return ggml_reshape_2d(ctx0, out, out->ne[0]*out->ne[1], out->ne[2]);
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

// as the stock iSWA input: the graph serves again while the window cache's view keeps its size (its n_kv grows
// while the window fills, then stays) and the ott part's shape is the same
bool llm_graph_input_attn_kv_ott_iswa::can_reuse(const llm_graph_params & params) {
    const auto * m = dynamic_cast<const llama_kv_cache_ott_iswa_context *>(params.mctx);
    if (!m || m->get_ott()->get_kv() != ott.mctx_ott->get_kv()) {
        return false;
    }
    mctx_oi = m;
    ott.mctx_ott = m->get_ott();
    bool res = ott.ub_plan->ne[1] == (int64_t) ott.mctx_ott->get_plan().size() &&
               params.ubatch.n_tokens == ott.n_tokens;
    if (self_k_idxs_swa && self_k_idxs_swa->buffer) {
        res &= self_k_idxs_swa->ne[0] == params.ubatch.n_tokens;
    }
    if (self_kq_mask_swa && self_kq_mask_swa->buffer) {
        const int64_t n_stream = params.cparams.kv_unified ? 1 : params.ubatch.n_seqs_unq;
        res &= self_kq_mask_swa->ne[0] == (int64_t) m->get_swa()->get_n_kv();
        res &= self_kq_mask_swa->ne[1] == params.ubatch.n_tokens/n_stream;
        res &= self_kq_mask_swa->ne[3] == n_stream;
    }
    return res;
}

std::unique_ptr<llm_graph_input_attn_kv_iswa> llama_ott_build_input_iswa(ggml_context * ctx0,
        const llama_ubatch & ubatch, const llama_hparams & hparams, const llama_cparams & cparams,
        const llama_memory_context_i * mctx_any) {
    const auto * mctx = dynamic_cast<const llama_kv_cache_ott_iswa_context *>(mctx_any);
    if (!mctx) {
        return nullptr;
    }
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
    inp->ott.build(ctx0, ubatch); // the ott plan, as for a model without windows
    return inp;
}

const llama_kv_cache_context * llama_ott_iswa_swa_context(const llm_graph_input_attn_kv_iswa * inp) {
    const auto * oi = dynamic_cast<const llm_graph_input_attn_kv_ott_iswa *>(inp);
    return oi ? oi->mctx_oi->get_swa() : nullptr;
}
