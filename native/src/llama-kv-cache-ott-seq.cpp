// The ott cache: sequence operations (see llama-kv-cache-ott.h). Rare host-side edits of the state wherever it
// lives: tensors come to the host through the backend API, are edited there and written back.
#include "llama-kv-cache-ott.h"

#include "llama-impl.h"

#include "ggml-backend.h"

#include <cstring>
#include <utility>
#include <vector>

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
        if (p0 >= st.n_sealed*cfg.G) {
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
    const int32_t G = cfg.G;
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
            hk->unseal((int) D, skb.data(), svb.data(), n_keep, k.data(), v.data());
            const size_t meta_off = h*L.pool_meta->nb[1] + s*L.pool_meta->nb[2];
            const size_t pool_off = (h + L.op.H*s)*L.pool_kv->nb[3];
            ggml_backend_tensor_get(L.pool_meta, meta.data(), meta_off, meta.size()*sizeof(int32_t));
            ggml_backend_tensor_get(L.pool_kv, pool.data(), pool_off, pool.size()*sizeof(uint16_t));
            const ott_meta_row mr = { meta.data(), S };
            ott_slot_meta * slots = mr.slots();
            // the pools: entries inside [lo, p0) cover their placeholders, entries from lo on are dropped
            int32_t * counts[2] = { &mr.n_pool(), &mr.n_aux() };
            const int32_t base[2] = { 0, O };
            for (int which = 0; which < 2; ++which) {
                int32_t kept = 0;
                for (int32_t i = 0; i < *counts[which]; ++i) {
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
                *counts[which] = kept;
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
        LLAMA_LOG_ERROR("%s: %s: shifting positions (context shift) is not supported; nothing was changed\n", __func__,
                        kv_type.name);
    }
}

void llama_kv_cache_ott::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    GGML_UNUSED(seq_id);
    GGML_UNUSED(p0);
    GGML_UNUSED(p1);
    if (d != 1) {
        LLAMA_LOG_ERROR("%s: %s: dividing positions is not supported; nothing was changed\n", __func__, kv_type.name);
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
