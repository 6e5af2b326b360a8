// Sliding-window models: the ott cache on the full-attention layers next to a stock f16 llama_kv_cache for the
// window layers (see llama-kv-cache-ott.h).
#include "llama-kv-cache-ott.h"
#include "llama-kv-cache.h"

#include "llama-cparams.h"
#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model.h"

// ------------------------------------------------------------------------------ sliding-window composite

llama_kv_cache_ott_iswa::llama_kv_cache_ott_iswa(const llama_model & model, const llama_cparams & cparams,
                                                 const llama_ott_kv_pair & kv_type, const llama_ott_config & cfg) {
    const llama_hparams & hparams = model.hparams;
    kv_ott = std::make_unique<llama_kv_cache_ott>(model, cparams, kv_type, cfg,
                                                  [&](int32_t il) { return !hparams.is_swa(il); });
    // the window layers: what llama_kv_cache_iswa gives them (window + one ubatch, padded to 256), in f16
    const uint32_t n_seq = cparams.n_seq_max;
    const uint32_t size_swa = GGML_PAD(std::min(cparams.n_ctx_seq,
                                                hparams.n_swa*(cparams.kv_unified ? n_seq : 1) + cparams.n_ubatch), 256);
    LLAMA_LOG_INFO("%s: %s on the full-attention layers; window layers in an f16 cache of %u cells\n", __func__,
                   kv_type.name, size_swa);
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
        LLAMA_LOG_ERROR("%s: %s: the window layers' f16 cache has no room for the batch\n", __func__,
                        kv_ott->kv_type.name);
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
    // the ott cache refuses a lossy cut without changing anything: ask it first, so that a refusal leaves the
    // window cache untouched too
    if (!kv_ott->seq_rm(seq_id, p0, p1)) {
        return false;
    }
    return kv_swa->seq_rm(seq_id, p0, p1);
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

// the ott part, then the window part; PARTIAL_ONLY (server checkpoints) keeps only the window part, as
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

