// The ott cache: state save/load (see llama-kv-cache-ott.h).
#include "llama-kv-cache-ott.h"

#include "llama-io.h"

#include "ggml-backend.h"

#include <cstring>
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

// State: magic, version, the configuration (a state of another cache type or another configuration is refused,
// naming the field), the length of the body, the body, and a checksum of it (a truncated or corrupt state is
// refused before anything is applied). Body: per-layer shapes, then per stream its counters and the used parts
// of every tensor.
static const uint32_t OTT_STATE_MAGIC   = 0x3254544f; // "OTT2"
// 2: only the used ring rows and pool slots; 3: length and checksum; 4: K and V widths and v_rotate in the header;
// 5: each layer's K and V widths beside its shape (llama_ott_config.layer_widths); 6: k_mix in the header and
// beside each layer's widths; 7: v_sym likewise (its V blocks are 2 bytes shorter); 8: k_mix 2 (2-bit keys of
// mixed widths 1/2/3: a 2-bit layer's K blocks may mean either, its flag beside its widths says which); 9: k_young
// and v_young in the header, and the young keys (values) of the newest sealed groups after each head's sealed K (V)
// groups
static const uint32_t OTT_STATE_VERSION = 9;
static const int      OTT_STATE_HDR     = 16; // magic, version, G, R, Gv, outlier_num, aux_cap, no_outlier_layers,
                                              // n_layer, K bits, V bits, v_rotate, k_mix, v_sym, k_young,
                                              // v_young
static const uint64_t OTT_STATE_MAX_BODY = (uint64_t) 1 << 40;

// FNV-1a, 64 bits: detects truncation-free corruption (bit flips, overwritten ranges) of the body
static uint64_t ott_fnv1a(const uint8_t * p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; ++i) {
        h = (h ^ p[i]) * 0x100000001b3ull;
    }
    return h;
}

// the body is built and checked in host memory, through the same io interface the cache writes and reads with
class ott_body_writer : public llama_io_write_i {
public:
    std::vector<uint8_t> buf;
    void write(const void * src, size_t size) override {
        buf.insert(buf.end(), (const uint8_t *) src, (const uint8_t *) src + size);
    }
    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        const size_t at = buf.size();
        buf.resize(at + size);
        ggml_backend_tensor_get(tensor, buf.data() + at, offset, size);
    }
    size_t n_bytes() override { return buf.size(); }
};

class ott_body_reader : public llama_io_read_i {
public:
    ott_body_reader(const std::vector<uint8_t> & buf, const char * name) : buf(buf), name(name) {}
    void read(void * dst, size_t size) override {
        if (size > buf.size() - at) {
            throw std::runtime_error(std::string(name) + ": the state is corrupt (its body ends early)");
        }
        memcpy(dst, buf.data() + at, size);
        at += size;
    }
    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        std::vector<uint8_t> tmp(size);
        read(tmp.data(), size);
        ggml_backend_tensor_set(tensor, tmp.data(), offset, size);
    }
    size_t n_bytes() override { return at; }
    size_t left() const { return buf.size() - at; }

private:
    const std::vector<uint8_t> & buf;
    const char * name;
    size_t at = 0;
};

void llama_kv_cache_ott::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    GGML_UNUSED(flags);
    const uint32_t hdr[OTT_STATE_HDR] = { OTT_STATE_MAGIC, OTT_STATE_VERSION, (uint32_t) cfg.G, (uint32_t) cfg.R,
                                          (uint32_t) hk->Gv, (uint32_t) cfg.outlier_num, (uint32_t) cfg.aux_cap,
                                          (uint32_t) cfg.no_outlier_layers, (uint32_t) layers.size(),
                                          (uint32_t) kv_type.kbits, (uint32_t) kv_type.vbits,
                                          (uint32_t) cfg.v_rotate, (uint32_t) cfg.k_mix, (uint32_t) cfg.v_sym,
                                          (uint32_t) cfg.k_young, (uint32_t) cfg.v_young };
    ott_body_writer body;
    state_write_body(body, seq_id);
    const uint64_t len = body.buf.size(), sum = ott_fnv1a(body.buf.data(), body.buf.size());
    io.write(hdr, sizeof(hdr));
    io.write(&len, sizeof(len));
    io.write(body.buf.data(), body.buf.size());
    io.write(&sum, sizeof(sum));
}

void llama_kv_cache_ott::state_write_body(llama_io_write_i & io, llama_seq_id seq_id) const {
    for (const auto & L : layers) {
        const uint32_t shape[8] = { (uint32_t) L.op.D, (uint32_t) L.op.H, (uint32_t) L.op.T, (uint32_t) L.op.S,
                                    (uint32_t) L.op.kbits, (uint32_t) L.op.vbits,
                                    (uint32_t) ((L.op.flags & GGML_OTT_K_MIX) != 0),
                                    (uint32_t) ((L.op.flags & GGML_OTT_V_SYM) != 0) };
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
                // keys by age: the young keys of groups [n_sealed - A, n_sealed), oldest first
                for (int32_t g = std::max(0, streams[s].n_sealed - L.young_k()); g < streams[s].n_sealed; ++g) {
                    ott_write_tensor(io, L.sealed_k, L.young_k_offset(s, h, g), L.young_kbytes);
                }
                ott_write_tensor(io, L.sealed_v, h*L.sealed_v->nb[2] + s*L.sealed_v->nb[3], nsv);
                for (int32_t g = std::max(0, streams[s].n_sealed - L.young_v()); g < streams[s].n_sealed; ++g) {
                    ott_write_tensor(io, L.sealed_v, L.young_v_offset(s, h, g), L.young_vbytes);
                }
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
    llama_ott_record_error("");
    try {
        uint32_t hdr[OTT_STATE_HDR];
        io.read(hdr, 2*sizeof(uint32_t)); // magic and version first: an older header is shorter
        if (hdr[0] != OTT_STATE_MAGIC) {
            throw std::runtime_error(std::string(kv_type.name) +
                                     ": this state was not saved from an ott cache (another K/V cache type?)");
        }
        if (hdr[1] != OTT_STATE_VERSION) {
            throw std::runtime_error(std::string(kv_type.name) + ": the state has format version " +
                                     std::to_string(hdr[1]) + " (an earlier ott-gguf); this build reads version " +
                                     std::to_string(OTT_STATE_VERSION) + ": save it again with this build");
        }
        io.read(hdr + 2, sizeof(hdr) - 2*sizeof(uint32_t));
        const uint32_t mine[OTT_STATE_HDR - 2] = { (uint32_t) cfg.G, (uint32_t) cfg.R, (uint32_t) hk->Gv,
                                                   (uint32_t) cfg.outlier_num, (uint32_t) cfg.aux_cap,
                                                   (uint32_t) cfg.no_outlier_layers, (uint32_t) layers.size(),
                                                   (uint32_t) kv_type.kbits, (uint32_t) kv_type.vbits,
                                                   (uint32_t) cfg.v_rotate, (uint32_t) cfg.k_mix,
                                                   (uint32_t) cfg.v_sym, (uint32_t) cfg.k_young,
                                                   (uint32_t) cfg.v_young };
        const char * names[OTT_STATE_HDR - 2] = { "G", "R", "Gv", "outlier_num", "aux_cap", "no_outlier_layers",
                                                  "n_layer", "K bits", "V bits", "v_rotate", "k_mix", "v_sym",
                                                  "k_young", "v_young" };
        for (int i = 0; i < OTT_STATE_HDR - 2; ++i) {
            if (hdr[2 + i] != mine[i]) {
                throw std::runtime_error(std::string(kv_type.name) + ": the state was saved with another "
                                         "configuration: " + names[i] + "=" + std::to_string(hdr[2 + i]) +
                                         ", this cache has " + names[i] + "=" + std::to_string(mine[i]));
            }
        }
        uint64_t len = 0, sum = 0;
        std::vector<uint8_t> body;
        try {
            io.read(&len, sizeof(len));
            if (len > OTT_STATE_MAX_BODY) {
                throw std::runtime_error("length");
            }
            body.resize(len);
            io.read(body.data(), body.size());
            io.read(&sum, sizeof(sum));
        } catch (const std::exception &) {
            throw std::runtime_error(std::string(kv_type.name) + ": the state is truncated (its ott part announces " +
                                     std::to_string(len) + " bytes and a checksum, which are not all there)");
        }
        if (ott_fnv1a(body.data(), body.size()) != sum) {
            throw std::runtime_error(std::string(kv_type.name) + ": the state is corrupt (checksum mismatch)");
        }
        ott_body_reader reader(body, kv_type.name);
        state_read_body(reader, seq_id);
        if (reader.left() != 0) {
            throw std::runtime_error(std::string(kv_type.name) + ": the state is corrupt (bytes left over)");
        }
    } catch (const std::exception & e) {
        llama_ott_record_error(e.what()); // the reason, for callers that get only a failure code back
        throw;
    }
}

// Whether a k_mix K group's width table (at byte offset off of sealed_k, after D blocks of kb bytes) is one the kernels
// can walk: D/4 channels of each outer width (kbits -+ 1, codes 0 and 2), no unknown width code (a crafted state
// could otherwise make them read past a group).
static bool ott_width_table_ok(const ott_layer & L, size_t off, size_t kb) {
    const size_t D = (size_t) L.op.D;
    std::vector<uint8_t> tbl(D/4);
    ggml_backend_tensor_get(L.sealed_k, tbl.data(), off + D*kb, tbl.size());
    size_t count[4] = {};
    for (size_t c = 0; c < D; ++c) {
        count[(tbl[c/4] >> (2*(c%4))) & 3]++;
    }
    return count[3] == 0 && count[0] == D/4 && count[2] == D/4;
}

// the same for the sealed K groups [0, n_sealed) of (stream s, head h) of a k_mix layer, and for its young keys
static bool ott_width_tables_ok(const ott_layer & L, int32_t s, int32_t h, int32_t n_sealed) {
    const size_t D = (size_t) L.op.D, gbytes = L.sealed_k->nb[1];
    for (int32_t g = 0; (L.op.flags & GGML_OTT_K_MIX) && g < n_sealed; ++g) {
        if (!ott_width_table_ok(L, h*L.sealed_k->nb[2] + s*L.sealed_k->nb[3] + g*gbytes, (gbytes - D/4)/D)) {
            return false;
        }
    }
    for (int32_t g = std::max(0, n_sealed - L.young_k()); (L.op.flags & GGML_OTT_K_YOUNG_MIX) && g < n_sealed; ++g) {
        if (!ott_width_table_ok(L, L.young_k_offset(s, h, g), (L.young_kbytes - D/4)/D)) {
            return false;
        }
    }
    return true;
}

void llama_kv_cache_ott::state_read_body(llama_io_read_i & io, llama_seq_id seq_id) {
    for (const auto & L : layers) {
        uint32_t shape[8];
        io.read(shape, sizeof(shape));
        if (shape[0] != (uint32_t) L.op.D || shape[1] != (uint32_t) L.op.H || shape[2] != (uint32_t) L.op.T || shape[3] != (uint32_t) L.op.S) {
            throw std::runtime_error(std::string(kv_type.name) + ": the state's layer shapes differ from this model's");
        }
        const uint32_t kmix = (L.op.flags & GGML_OTT_K_MIX) != 0;
        const uint32_t vsym = (L.op.flags & GGML_OTT_V_SYM) != 0;
        if (shape[4] != (uint32_t) L.op.kbits || shape[5] != (uint32_t) L.op.vbits || shape[6] != kmix ||
            shape[7] != vsym) {
            throw std::runtime_error(std::string(kv_type.name) + ": the state was saved with another configuration: "
                                     "layer " + std::to_string(L.il) + " has K/V bits " + std::to_string(shape[4]) +
                                     (shape[6] ? "m" : "") + "/" + std::to_string(shape[5]) + (shape[7] ? "s" : "") +
                                     " there, " + std::to_string(L.op.kbits) + (kmix ? "m" : "") + "/" +
                                     std::to_string(L.op.vbits) + (vsym ? "s" : "") +
                                     " in this cache (layer_widths, k_mix, v_sym; m: mixed K widths, s: symmetric V)");
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
                for (int32_t g = std::max(0, rec[2] - L.young_k()); g < rec[2]; ++g) {
                    ott_read_tensor(io, L.sealed_k, L.young_k_offset(s, h, g), L.young_kbytes);
                }
                if (!ott_width_tables_ok(L, s, h, rec[2])) {
                    reset_stream_meta((uint32_t) s);
                    throw std::runtime_error(std::string(kv_type.name) + ": the state's K width tables are not "
                                             "k_mix's quotas (a corrupt state)");
                }
                ott_read_tensor(io, L.sealed_v, h*L.sealed_v->nb[2] + s*L.sealed_v->nb[3], (size_t) rec[2]*L.sealed_v->nb[1]);
                for (int32_t g = std::max(0, rec[2] - L.young_v()); g < rec[2]; ++g) {
                    ott_read_tensor(io, L.sealed_v, L.young_v_offset(s, h, g), L.young_vbytes);
                }
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
