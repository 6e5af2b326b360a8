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
        if (!can_cut(st.n_sealed, p0)) {
            // a fresh run over [0, p0) would hold in fp16 tokens that are sealed here (2-bit): refuse, change
            // nothing; the caller re-processes from 0 (llama-server, ott_gguf.Llama), as for caches that cannot
            // cut everywhere
            return false;
        }
    }
    for (uint32_t s : targets) {
        ott_stream & st = streams[s];
        if (p0 >= st.n_pos) {
            continue;
        }
        if (p0 == 0) {
            reset_stream_meta(s);
            continue;
        }
        st.n_pos = p0; // inside the fp16 tail: the ring slots past p0 are simply unused
    }
    return true;
}

bool llama_kv_cache_ott::seq_can_cut(llama_seq_id seq_id, llama_pos p0) const {
    if (seq_id < 0 || (uint32_t) seq_id >= n_stream) {
        return true;
    }
    const ott_stream & st = streams[seq_id];
    return p0 >= st.n_pos || can_cut(st.n_sealed, p0);
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
