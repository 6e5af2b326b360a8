// ott-gguf: CPU implementations of the ott2 cache's ops (ggml-ott.h), around the generated per-head kernels
// (ott2-head.c, compiled into ggml-cpu with its ISA flags; one set per K/V width pair, found by ott_head_find). Work units and arithmetic: docs/design-ott2-cache.md.
#include "ggml-cpu-ott.h"
#include "ggml-ott.h"
#include "ggml-cpu-impl.h"
#include "ott2-head.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// A slice's first sealed group (K and V blocks, about 5 KB at D 64) into L2 ahead of its kernel: the state of a long
// context is read from DRAM (the weights stream through L3 every token). Each attn_group call prefetches the group
// after it in parts spread over its own work (ott_head.c.j2), which a burst here before every call did not match.
static void ott_prefetch_l2(const char * p, size_t n) {
#if defined(__GNUC__)
    for (size_t o = 0; o < n; o += 64) {
        __builtin_prefetch(p + o, 0, 1);
    }
#else
    (void) p; (void) n;
#endif
}

struct ott_views {
    const ggml_ott_params & p;
    const ggml_tensor * kc, * vc, * ring, * sk, * sv, * pkv, * pmeta, * plan;
    int64_t ns, n_tok;

    const int32_t * plan_of(int64_t si) const { return (const int32_t *) plan->data + 4*si; }
    int32_t * meta(int32_t s, uint32_t h) const {
        return (int32_t *) ((char *) pmeta->data + h*pmeta->nb[1] + s*pmeta->nb[2]);
    }
    uint16_t * pool(int32_t s, uint32_t h) const { return (uint16_t *) ((char *) pkv->data + (h + p.H*s)*pkv->nb[3]); }
    uint16_t * ring_row(int32_t s, uint32_t h, int32_t pos, int kv) const {
        return (uint16_t *) ((char *) ring->data + h*ring->nb[1] + (pos % p.T)*ring->nb[2] + (2*s + kv)*ring->nb[3]);
    }
    const float * cur_row(const ggml_tensor * t, uint32_t h, int64_t tok) const {
        return (const float *) ((const char *) t->data + h*t->nb[1] + tok*t->nb[2]);
    }
    char * sealed(const ggml_tensor * t, int32_t s, uint32_t h) const {
        return (char *) t->data + h*t->nb[2] + s*t->nb[3];
    }
};

// keys and values by age (ggml-ott.h, GGML_OTT_K_YOUNG_SHIFT): the newest AK sealed groups' keys and the newest AV
// groups' values are read from rings past the NG group slots of sealed_k / sealed_v, at the next wider format. Per
// group, the kernels of its (K format, V format) and where its K and V blocks are.
struct ott_young {
    const ott_head_kernels * hk = nullptr;    // the layer's formats
    const ott_head_kernels * by[4] = {};      // by[ky + 2*vy]: K young (ky), V young (vy)
    int32_t AK = 0, AV = 0;
    size_t kbytes = 0, vbytes = 0, ykbytes = 0, yvbytes = 0;

    ott_young(const ggml_ott_params & p, const ggml_tensor * sk, const ggml_tensor * sv) {
        const int kmix = (p.flags & GGML_OTT_K_MIX) != 0, vsym = (p.flags & GGML_OTT_V_SYM) != 0;
        const int ykmix = (p.flags & GGML_OTT_K_YOUNG_MIX) != 0;
        AK = ggml_ott_k_young(&p);
        AV = ggml_ott_v_young(&p);
        hk = ott_head_find(p.kbits, p.vbits, kmix, vsym);
        GGML_ASSERT(hk && (uint32_t) hk->G == (uint32_t) p.G && hk->Gv == p.Gv);
        for (int ky = 0; ky < 2; ++ky) {
            for (int vy = 0; vy < 2; ++vy) {
                if ((ky && !AK) || (vy && !AV)) {
                    continue;
                }
                // young values are never symmetric blocks (those are 2-bit only)
                by[ky + 2*vy] = ott_head_find(p.kbits + ky, p.vbits + vy, ky ? ykmix : kmix, vy ? 0 : vsym);
                GGML_ASSERT(by[ky + 2*vy] && by[ky + 2*vy]->G == hk->G && by[ky + 2*vy]->Gv == hk->Gv);
            }
        }
        kbytes = ott_head_kbytes(hk, p.D);
        vbytes = (size_t) p.G*(p.D/p.Gv)*hk->vb;
        if (AK) {
            ykbytes = ott_head_kbytes(by[1], p.D);
            GGML_ASSERT((size_t) AK*ykbytes <= (size_t) (sk->ne[1] - p.NG)*sk->nb[1]);
        }
        if (AV) {
            yvbytes = (size_t) p.G*(p.D/p.Gv)*by[2]->vb;
            GGML_ASSERT((size_t) AV*yvbytes <= (size_t) (sv->ne[1] - p.NG)*sv->nb[1]);
        }
    }
    bool k_young(int32_t g, int32_t n_sealed) const { return AK && g >= n_sealed - AK; }
    bool v_young(int32_t g, int32_t n_sealed) const { return AV && g >= n_sealed - AV; }
    const ott_head_kernels * kernels(int32_t g, int32_t n_sealed) const {
        return by[k_young(g, n_sealed) + 2*v_young(g, n_sealed)]; // by[0] is hk; the others exist where used
    }
    // group g's K (V) blocks in a head's region of sealed_k (sealed_v), base: the region's start
    char * k_at(char * base, int32_t g, int32_t NG, bool young) const {
        return young ? base + (size_t) NG*kbytes + (size_t) (g % AK)*ykbytes : base + (size_t) g*kbytes;
    }
    char * v_at(char * base, int32_t g, int32_t NG, bool young) const {
        return young ? base + (size_t) NG*vbytes + (size_t) (g % AV)*yvbytes : base + (size_t) g*vbytes;
    }
};

ott_views views_of(const ggml_tensor * dst, const ggml_ott_params & p) {
    ott_views v{ p, dst->src[1], dst->src[2], dst->src[3], dst->src[4], dst->src[5], dst->src[6], dst->src[7],
                 dst->src[8], 0, 0 };
    v.ns = v.plan->ne[1];
    v.n_tok = v.kc->ne[2] / v.ns;
    return v;
}

// Attention runs as two ops. The partial op splits each (stream, KV head) into units: NS slices of the sealed
// groups (decode: flash-decoding over the sequence, so a single head still keeps every thread busy) and the
// fp16 tail, each for a chunk of OTT_TOK_CHUNK tokens of the ubatch (all of its query heads, so the codes of a
// group are unpacked once for the GQA heads and tokens). A unit writes an online-softmax state per row into
// `part`; the merge op combines the NS + 1 states of each row.
constexpr int64_t OTT_TOK_CHUNK = 32;

// rows of one (stream, KV head): row r = t*gq + k for ubatch token t and query head h*gq + k
// part: F32 [D + 2, gq*n_tok, H, ns*(NS + 1)]: acc[0, D), M at D, L at D + 1
// With a threadpool each thread first runs its home range (below), then takes units from the pool's shared counter,
// the largest first: the fp16 tails (the recent window plus the ubatch: 5 us at D 64 on a Zen 4, against 1.3 us per
// sealed group), then the sealed units left, so the threads finish together; a static stride put every tail on one
// thread. Which thread runs a unit changes nothing it computes.
void ott_attn_part(ggml_tensor * dst, int ith, int nth, ggml_threadpool * tp) {
    const ggml_ott_params & p = *(const ggml_ott_params *) dst->op_params;
    const ott_views v = views_of(dst, p);
    const ggml_tensor * q = dst->src[0];
    const uint32_t D = p.D, G = p.G, gq = p.n_head / p.H, O = (uint32_t) p.outlier_num;
    const int64_t NS1 = p.NS + 1; // sealed slices + 1 tail unit
    const int64_t n_tc = (v.n_tok + OTT_TOK_CHUNK - 1) / OTT_TOK_CHUNK;
    const ott_young yk(p, v.sk, v.sv); // the layer's kernels, and those of young groups (k_young, v_young)
    const size_t kbytes = yk.kbytes, vbytes = yk.vbytes;
    // per-thread buffers that keep their capacity across layers and tokens (no allocation per op)
    thread_local std::vector<float> scratch, qb, acc, M, L;
    thread_local std::vector<int32_t> qpos, cj;
    thread_local std::vector<uint16_t> ck, cv, tk, tv;
    scratch.resize((size_t) 2*G*D + 16);
    const int64_t n_tails = v.ns*p.H*n_tc;
    // Sealed units with groups in them, in memory order (stream, head, slice, chunk), and the empty ones. Each thread
    // first runs a contiguous home range of the non-empty ones, so the group after its current one is the one it
    // reads next (the kernel prefetches it, the hardware prefetcher keeps its streams): units dealt one at a time
    // alternate between the threads and every slice (4 groups at decode) started cold. The last quarter and the
    // empty units are taken from the shared counter after the tails, so the threads still finish together.
    const int32_t SG = ggml_ott_slice_groups(p.NG, p.NS); // absolute slices: batch invariance
    thread_local std::vector<int64_t> full_from; // per stream: its first non-empty unit's index
    full_from.resize(v.ns + 1);
    int64_t n_full = 0;
    for (int64_t si = 0; si < v.ns; ++si) {
        full_from[si] = n_full;
        n_full += p.H*std::min<int64_t>(p.NS, (v.plan_of(si)[2] + SG - 1)/SG)*n_tc;
    }
    full_from[v.ns] = n_full;
    const int64_t n_empty = v.ns*p.H*p.NS*n_tc - n_full;
    const int64_t n_home = tp && nth > 1 ? n_full*3/4 : 0;
    const int64_t n_units = n_tails + (n_full - n_home) + n_empty; // taken from the counter
    // unit w of the non-empty ones, or of the empty ones -> (stream, head, slice, chunk)
    auto full_unit = [&](int64_t w, int64_t & si, uint32_t & h, int64_t & k, int64_t & tc) {
        si = std::upper_bound(full_from.begin(), full_from.end(), w) - full_from.begin() - 1;
        const int64_t nk = (full_from[si + 1] - full_from[si])/(p.H*n_tc), r = w - full_from[si];
        tc = r % n_tc; k = (r / n_tc) % nk; h = (uint32_t) (r / (n_tc*nk));
    };
    auto empty_unit = [&](int64_t e, int64_t & si, uint32_t & h, int64_t & k, int64_t & tc) {
        for (si = 0; si < v.ns; ++si) {
            const int64_t nk = (full_from[si + 1] - full_from[si])/(p.H*n_tc), ne = p.H*(p.NS - nk)*n_tc;
            if (e < ne) {
                tc = e % n_tc; k = nk + (e / n_tc) % (p.NS - nk); h = (uint32_t) (e / (n_tc*(p.NS - nk)));
                return;
            }
            e -= ne;
        }
        GGML_ABORT("ott_attn_part: empty unit out of range");
    };
    if (tp) {
        if (ith == 0) {
            ggml_threadpool_chunk_set(tp, nth);
        }
        ggml_barrier(tp); // the counter is shared with every op: set before anyone takes from it
    }
    const int64_t home0 = n_home*ith/nth, home1 = n_home*(ith + 1)/nth;
    int64_t o = ith, w_home = home0; // o: the counter's value this thread holds
    while (true) {
        int64_t si, k, tc;
        uint32_t h;
        bool took = true; // the unit came from the counter: take the next value after it
        if (o < n_tails) { // [tails: si, h, tc]
            tc = o % n_tc; h = (uint32_t) ((o / n_tc) % p.H); si = o / (n_tc*p.H); k = NS1 - 1;
        } else if (w_home < home1) {
            full_unit(w_home++, si, h, k, tc);
            took = false;
        } else if (o < n_units) {
            const int64_t d = o - n_tails;
            if (d < n_full - n_home) {
                full_unit(n_home + d, si, h, k, tc);
            } else {
                empty_unit(d - (n_full - n_home), si, h, k, tc);
            }
        } else {
            break;
        }
        const int32_t * pl = v.plan_of(si);
        const int32_t s = pl[0], n_pos = pl[1], n_sealed = pl[2];
        const int64_t t0 = tc*OTT_TOK_CHUNK, t1 = std::min(v.n_tok, t0 + OTT_TOK_CHUNK);
        const int64_t nr = (t1 - t0)*gq;
        qb.resize((size_t) nr*D); qpos.resize(nr);
        acc.assign((size_t) nr*D, 0.0f); M.assign(nr, -INFINITY); L.assign(nr, 0.0f);
        for (int64_t t = t0; t < t1; ++t) {
            for (uint32_t kq = 0; kq < gq; ++kq) {
                const int64_t r = (t - t0)*gq + kq;
                memcpy(&qb[(size_t) r*D], (const char *) q->data + (h*gq + kq)*q->nb[1] + (si*v.n_tok + t)*q->nb[2],
                       D*sizeof(float));
                qpos[r] = n_pos + (int32_t) t;
            }
        }
        if (k < NS1 - 1) {
            // sealed groups [g0, g1) of this slice; pooled tokens inside a group cover it
            const int32_t g0 = std::min(n_sealed, (int32_t) k*SG), g1 = std::min(n_sealed, (int32_t) (k + 1)*SG);
            const int32_t * meta = v.meta(s, h);
            const ott_slot_meta * slots = (const ott_slot_meta *) meta;
            const int32_t n_pool = meta[2*p.S], n_aux = meta[2*p.S + 1];
            const uint16_t * pool = v.pool(s, h);
            const char * gk = (const char *) v.sealed(v.sk, s, h), * gv = (const char *) v.sealed(v.sv, s, h);
            if (g0 < g1) {
                ott_prefetch_l2(gk + g0*kbytes, kbytes);
                ott_prefetch_l2(gv + g0*vbytes, vbytes);
            }
            for (int32_t g = g0; g < g1; ++g) {
                cj.clear(); ck.clear(); cv.clear();
                for (int32_t i = 0; i < n_pool + n_aux; ++i) {
                    const uint32_t slot = i < n_pool ? (uint32_t) i : O + (uint32_t) (i - n_pool);
                    const int32_t j = slots[slot].pos - g*(int32_t) G;
                    if (j >= 0 && j < (int32_t) G) {
                        cj.push_back(j);
                        ck.insert(ck.end(), pool + (size_t) slot*D, pool + (size_t) (slot + 1)*D);
                        cv.insert(cv.end(), pool + (size_t) (p.S + slot)*D, pool + (size_t) (p.S + slot + 1)*D);
                    }
                }
                // keys and values by age: the newest groups' keys (values) from their rings, at the wider format
                yk.kernels(g, n_sealed)->attn_group((int) D, (int) nr, qb.data(), p.scale,
                               yk.k_at((char *) gk, g, p.NG, yk.k_young(g, n_sealed)),
                               yk.v_at((char *) gv, g, p.NG, yk.v_young(g, n_sealed)),
                               (int) cj.size(), cj.data(), ck.data(), cv.data(), ((p.flags & GGML_OTT_V_ROTATE) != 0),
                               M.data(), L.data(), acc.data(), scratch.data());
            }
        } else {
            // the fp16 tail this chunk sees: ring positions [n_sealed*G, n_pos), then ubatch tokens [0, t1), in
            // kernel calls of G positions from n_sealed*G (fixed boundaries: batch invariance). A call whose
            // positions all sit unwrapped in the ring reads it in place; the others are gathered into tk/tv.
            const int32_t lo = n_sealed*(int32_t) G;
            const int64_t n_tail = (n_pos - lo) + t1;
            const int ring_stride = (int) (v.ring->nb[2]/sizeof(uint16_t));
            tk.resize((size_t) G*D); tv.resize((size_t) G*D);
            for (int64_t j0 = 0; j0 < n_tail; j0 += G) {
                const int n_t = (int) std::min<int64_t>(G, n_tail - j0);
                const int32_t pos0 = lo + (int32_t) j0;
                const uint16_t * ck0 = v.ring_row(s, h, pos0, 0), * cv0 = v.ring_row(s, h, pos0, 1);
                int stride = ring_stride;
                if (pos0 + n_t > n_pos || pos0 % p.T + n_t > p.T) {
                    for (int j = 0; j < n_t; ++j) {
                        const int32_t pos = pos0 + j;
                        if (pos < n_pos) {
                            memcpy(&tk[(size_t) j*D], v.ring_row(s, h, pos, 0), D*sizeof(uint16_t));
                            memcpy(&tv[(size_t) j*D], v.ring_row(s, h, pos, 1), D*sizeof(uint16_t));
                        } else { // rounded to fp16 as the ring will keep them
                            const int64_t t = si*v.n_tok + (pos - n_pos);
                            ggml_fp32_to_fp16_row(v.cur_row(v.kc, h, t), (ggml_fp16_t *) &tk[(size_t) j*D], D);
                            ggml_fp32_to_fp16_row(v.cur_row(v.vc, h, t), (ggml_fp16_t *) &tv[(size_t) j*D], D);
                        }
                    }
                    ck0 = tk.data(); cv0 = tv.data(); stride = (int) D;
                }
                yk.hk->attn_tail((int) D, (int) nr, qb.data(), qpos.data(), p.scale, n_t, pos0, ck0, cv0, stride,
                              M.data(), L.data(), acc.data(), scratch.data());
            }
        }
        for (int64_t r = 0; r < nr; ++r) {
            float * out = (float *) ((char *) dst->data + (t0*gq + r)*dst->nb[1] + h*dst->nb[2] + (si*NS1 + k)*dst->nb[3]);
            memcpy(out, &acc[(size_t) r*D], D*sizeof(float));
            out[D] = M[r];
            out[D + 1] = L[r];
        }
        if (took) {
            o = tp ? ggml_threadpool_chunk_add(tp, 1) : o + nth;
        }
    }
}

// out[hq, token] = sum_k e^(M_k - M) acc_k / sum_k e^(M_k - M) L_k over the NS + 1 states of the row; with
// rotated V the NS sealed states are in the rotated basis: their sum is turned back once, before the tail's state
void ott_attn_merge(ggml_tensor * dst, int ith, int nth) {
    const ggml_ott_params & p = *(const ggml_ott_params *) dst->op_params;
    const ggml_tensor * part = dst->src[0];
    const uint32_t D = p.D, gq = p.n_head / p.H;
    const int64_t n_rows = dst->ne[1]*dst->ne[2]; // (query head, token) over every stream
    const int64_t n_tok = part->ne[1] / gq, ns = dst->ne[2] / n_tok, NS1 = part->ne[3] / ns;
    for (int64_t i = ith; i < n_rows; i += nth) {
        const int64_t hq = i % dst->ne[1], tok = i / dst->ne[1];
        const int64_t si = tok / n_tok, t = tok % n_tok, h = hq / gq, r = t*gq + hq % gq;
        auto state = [&](int64_t k) {
            return (const float *) ((const char *) part->data + r*part->nb[1] + h*part->nb[2] + (si*NS1 + k)*part->nb[3]);
        };
        float mx = -INFINITY;
        for (int64_t k = 0; k < NS1; ++k) {
            const float * st = state(k);
            if (st[D + 1] > 0.0f) {
                mx = std::max(mx, st[D]);
            }
        }
        float * out = (float *) ((char *) dst->data + hq*dst->nb[1] + tok*dst->nb[2]);
        for (uint32_t c = 0; c < D; ++c) {
            out[c] = 0.0f;
        }
        float l = 0.0f;
        for (int64_t k = 0; k < NS1; ++k) {
            if (((p.flags & GGML_OTT_V_ROTATE) != 0) && k == NS1 - 1) {
                ott_head_unrotate((int) D, out);
            }
            const float * st = state(k);
            if (st[D + 1] <= 0.0f) {
                continue; // an empty slice
            }
            const float w = expf(st[D] - mx);
            l += w*st[D + 1];
            for (uint32_t c = 0; c < D; ++c) {
                out[c] += w*st[c];
            }
        }
        const float il = l > 0.0f ? 1.0f/l : 0.0f;
        for (uint32_t c = 0; c < D; ++c) {
            out[c] *= il;
        }
    }
}

// after the layer's attention: seal the groups the ubatch made eligible, then keep its unsealed tokens in the ring
void ott_seal(ggml_tensor * dst, int ith, int nth) {
    const ggml_ott_params & p = *(const ggml_ott_params *) dst->op_params;
    int32_t * flags = (int32_t *) dst->src[9]->data;
    const ott_views v = views_of(dst, p);
    const uint32_t D = p.D, G = p.G, O = (uint32_t) p.outlier_num;
    const ott_young yk(p, v.sk, v.sv);
    const ott_head_kernels * hk = yk.hk;
    const size_t kbytes = yk.kbytes, vbytes = yk.vbytes;
    std::vector<uint16_t> gk((size_t) G*D), gv((size_t) G*D);
    for (int64_t u = ith; u < v.ns*p.H; u += nth) {
        const int64_t si = u / p.H;
        const uint32_t h = (uint32_t) (u % p.H);
        const int32_t * pl = v.plan_of(si);
        const int32_t s = pl[0], n_pos = pl[1], n_sealed = pl[2], n_sealed_after = pl[3];
        int32_t * meta = v.meta(s, h);
        ott_slot_meta * slots = (ott_slot_meta *) meta;
        uint16_t * pool = v.pool(s, h);
        for (int32_t g = n_sealed; g < n_sealed_after; ++g) {
            for (uint32_t t = 0; t < G; ++t) {
                const int32_t pos = g*(int32_t) G + (int32_t) t;
                if (pos < n_pos) {
                    memcpy(&gk[(size_t) t*D], v.ring_row(s, h, pos, 0), D*sizeof(uint16_t));
                    memcpy(&gv[(size_t) t*D], v.ring_row(s, h, pos, 1), D*sizeof(uint16_t));
                } else {
                    const int64_t tok = si*v.n_tok + (pos - n_pos);
                    ggml_fp32_to_fp16_row(v.cur_row(v.kc, h, tok), (ggml_fp16_t *) &gk[(size_t) t*D], D);
                    ggml_fp32_to_fp16_row(v.cur_row(v.vc, h, tok), (ggml_fp16_t *) &gv[(size_t) t*D], D);
                }
            }
            int n_pool = meta[2*p.S], n_aux = meta[2*p.S + 1], tracing = meta[2*p.S + 2];
            hk->seal((int) D, gk.data(), gv.data(), g*(int32_t) G, p.outlier_num, p.aux_cap,
                     slots, pool, pool + (size_t) p.S*D, &n_pool,
                     slots + O, pool + (size_t) O*D, pool + (size_t) (p.S + O)*D, &n_aux, &tracing,
                     ((p.flags & GGML_OTT_V_ROTATE) != 0), v.sealed(v.sk, s, h) + g*kbytes, v.sealed(v.sv, s, h) + g*vbytes);
            // keys and values by age: the same keys and values (placeholders written) at the wider formats, into
            // the rings (the slot of the group that has just aged out)
            if (yk.AK) {
                yk.by[1]->quant_k((int) D, gk.data(), yk.k_at(v.sealed(v.sk, s, h), g, p.NG, true));
            }
            if (yk.AV) {
                yk.by[2]->quant_v((int) D, gv.data(), ((p.flags & GGML_OTT_V_ROTATE) != 0),
                                  yk.v_at(v.sealed(v.sv, s, h), g, p.NG, true));
            }
            meta[2*p.S] = n_pool;
            meta[2*p.S + 1] = n_aux;
            meta[2*p.S + 2] = tracing;
        }
        for (int64_t t = 0; t < v.n_tok && !flags[s]; ++t) {
            const float * kr = v.cur_row(v.kc, h, si*v.n_tok + t);
            const float * vr = v.cur_row(v.vc, h, si*v.n_tok + t);
            for (uint32_t c = 0; c < D; ++c) {
                if (!std::isfinite(kr[c]) || !std::isfinite(vr[c])) {
                    flags[s] = 1; // a benign race: every writer stores 1
                    break;
                }
            }
        }
        const int32_t keep_from = std::max(n_pos, n_sealed_after*(int32_t) G);
        for (int64_t t = 0; t < v.n_tok; ++t) {
            const int32_t pos = n_pos + (int32_t) t;
            if (pos < keep_from) {
                continue;
            }
            ggml_fp32_to_fp16_row(v.cur_row(v.kc, h, si*v.n_tok + t), (ggml_fp16_t *) v.ring_row(s, h, pos, 0), D);
            ggml_fp32_to_fp16_row(v.cur_row(v.vc, h, si*v.n_tok + t), (ggml_fp16_t *) v.ring_row(s, h, pos, 1), D);
        }
    }
}

} // namespace

// the ops' code: the CPU kernels above, or what a test registered (ggml-cpu-ott.h)
static std::atomic<const ggml_ott_cpu_impl *> ott_impl{nullptr};

void ggml_ott_cpu_set_impl(const struct ggml_ott_cpu_impl * impl) {
    ott_impl.store(impl);
}

void ggml_compute_forward_ott_attn_part(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const ggml_ott_cpu_impl * impl = ott_impl.load(std::memory_order_acquire);
    if (impl) {
        impl->attn_part(dst, params->ith, params->nth);
    } else {
        ott_attn_part(dst, params->ith, params->nth, params->threadpool);
    }
}

void ggml_compute_forward_ott_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const ggml_ott_cpu_impl * impl = ott_impl.load(std::memory_order_acquire);
    (impl ? impl->attn : ott_attn_merge)(dst, params->ith, params->nth);
}

void ggml_compute_forward_ott_seal(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const ggml_ott_cpu_impl * impl = ott_impl.load(std::memory_order_acquire);
    (impl ? impl->seal : ott_seal)(dst, params->ith, params->nth);
}
