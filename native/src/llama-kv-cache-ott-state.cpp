// The ott cache: state save/load (see llama-kv-cache-ott.h).
#include "llama-kv-cache-ott.h"

#include "llama-io.h"

#include "ggml-backend.h"

#include <stdexcept>
#include <string>
#include <vector>

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
    const uint32_t hdr[9] = { OTT_STATE_MAGIC, OTT_STATE_VERSION, (uint32_t) cfg.G, (uint32_t) cfg.R, OTT2_HEAD_GV,
                              (uint32_t) cfg.outlier_num, (uint32_t) cfg.aux_cap, (uint32_t) cfg.no_outlier_layers,
                              (uint32_t) layers.size() };
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
                    for (int32_t pos = streams[s].n_sealed*cfg.G; pos < streams[s].n_pos; ++pos) {
                        ott_write_tensor(io, L.ring, h*L.ring->nb[1] + (pos % L.op.T)*L.ring->nb[2] +
                                         (2*s + kv)*L.ring->nb[3], L.op.D*sizeof(ggml_fp16_t));
                    }
                }
                std::vector<int32_t> meta(L.pool_meta->ne[0]);
                ggml_backend_tensor_get(L.pool_meta, meta.data(), h*L.pool_meta->nb[1] + s*L.pool_meta->nb[2],
                                        L.pool_meta->nb[1]);
                io.write(meta.data(), L.pool_meta->nb[1]);
                const ott_meta_row mr = { meta.data(), L.op.S };
                const size_t pool = (h + L.op.H*s)*L.pool_kv->nb[3];
                const size_t row = L.op.D*sizeof(ggml_fp16_t);
                const int32_t O = L.op.outlier_num;
                for (int kv = 0; kv < 2; ++kv) {
                    ott_write_tensor(io, L.pool_kv, pool + (kv*L.op.S)*row, (size_t) mr.n_pool()*row);
                    ott_write_tensor(io, L.pool_kv, pool + (kv*L.op.S + O)*row, (size_t) mr.n_aux()*row);
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
        throw std::runtime_error(std::string(kv_type.name) + 
                                 ": this state was not saved from an ott cache (another K/V cache type?)");
    }
    if (hdr[1] != OTT_STATE_VERSION) {
        throw std::runtime_error(std::string(kv_type.name) + ": state version " + std::to_string(hdr[1]) + ", this build reads version " +
                                 std::to_string(OTT_STATE_VERSION));
    }
    const uint32_t mine[7] = { (uint32_t) cfg.G, (uint32_t) cfg.R, OTT2_HEAD_GV, (uint32_t) cfg.outlier_num,
                               (uint32_t) cfg.aux_cap, (uint32_t) cfg.no_outlier_layers,
                               (uint32_t) layers.size() };
    const char * names[7] = { "G", "R", "Gv", "outlier_num", "aux_cap", "no_outlier_layers", "n_layer" };
    for (int i = 0; i < 7; ++i) {
        if (hdr[2 + i] != mine[i]) {
            throw std::runtime_error(std::string(kv_type.name) + ": the state was saved with " + names[i] + "=" +
                                     std::to_string(hdr[2 + i]) + ", this cache has " + names[i] + "=" +
                                     std::to_string(mine[i]));
        }
    }
    for (const auto & L : layers) {
        uint32_t shape[4];
        io.read(shape, sizeof(shape));
        if (shape[0] != (uint32_t) L.op.D || shape[1] != (uint32_t) L.op.H || shape[2] != (uint32_t) L.op.T || shape[3] != (uint32_t) L.op.S) {
            throw std::runtime_error(std::string(kv_type.name) + ": the state's layer shapes differ from this model's");
        }
    }
    uint32_t n = 0;
    io.read(&n, sizeof(n));
    if (seq_id >= 0 && n != 1) {
        throw std::runtime_error(std::string(kv_type.name) + ": a sequence state must hold exactly one sequence");
    }
    if (seq_id < 0) {
        clear(true);
    }
    for (uint32_t i = 0; i < n; ++i) {
        int32_t rec[3];
        io.read(rec, sizeof(rec));
        const int32_t s = seq_id >= 0 ? seq_id : rec[0];
        if (s < 0 || (uint32_t) s >= n_stream || rec[1] < 0 || (uint32_t) rec[1] > n_ctx_seq || rec[2] < 0 ||
            (int64_t) rec[2]*cfg.G > rec[1]) {
            throw std::runtime_error(std::string(kv_type.name) + ": the state does not fit this context (sequence " + std::to_string(s) +
                                     ", " + std::to_string(rec[1]) + " positions)");
        }
        reset_stream_meta((uint32_t) s); // counters, pool meta and the non-finite mark start over
        for (auto & L : layers) {
            for (int32_t h = 0; h < L.op.H; ++h) {
                ott_read_tensor(io, L.sealed_k, h*L.sealed_k->nb[2] + s*L.sealed_k->nb[3], (size_t) rec[2]*L.sealed_k->nb[1]);
                ott_read_tensor(io, L.sealed_v, h*L.sealed_v->nb[2] + s*L.sealed_v->nb[3], (size_t) rec[2]*L.sealed_v->nb[1]);
                for (int kv = 0; kv < 2; ++kv) {
                    for (int32_t pos = rec[2]*cfg.G; pos < rec[1]; ++pos) {
                        ott_read_tensor(io, L.ring, h*L.ring->nb[1] + (pos % L.op.T)*L.ring->nb[2] +
                                        (2*s + kv)*L.ring->nb[3], L.op.D*sizeof(ggml_fp16_t));
                    }
                }
                std::vector<int32_t> meta(L.pool_meta->ne[0]);
                io.read(meta.data(), L.pool_meta->nb[1]);
                const int32_t O = L.op.outlier_num;
                const ott_meta_row mr = { meta.data(), L.op.S };
                if (mr.n_pool() < 0 || mr.n_pool() > O || mr.n_aux() < 0 || mr.n_aux() > L.op.S - O) {
                    reset_stream_meta((uint32_t) s);
                    throw std::runtime_error(std::string(kv_type.name) +
                                             ": the state's pool counts are out of range (a corrupt state)");
                }
                ggml_backend_tensor_set(L.pool_meta, meta.data(), h*L.pool_meta->nb[1] + s*L.pool_meta->nb[2],
                                        L.pool_meta->nb[1]);
                const size_t pool = (h + L.op.H*s)*L.pool_kv->nb[3];
                const size_t row = L.op.D*sizeof(ggml_fp16_t);
                for (int kv = 0; kv < 2; ++kv) {
                    ott_read_tensor(io, L.pool_kv, pool + (kv*L.op.S)*row, (size_t) mr.n_pool()*row);
                    ott_read_tensor(io, L.pool_kv, pool + (kv*L.op.S + O)*row, (size_t) mr.n_aux()*row);
                }
            }
        }
        streams[s].n_pos = rec[1];
        streams[s].n_sealed = rec[2];
    }
}
