// ott-gguf tests: the CUDA kernels' emulation (ott2-emu-<tag>.cpp: gen/templates/ott_cuda_ops.j2 rendered as C++)
// as ggml-cpu's implementation of the ott2 ops, with the CUDA dispatch's arguments (ggml-ott-args.h) and the
// GPU's slicing: a model's graph then runs the CUDA path's logic end to end without a GPU. Single-threaded and
// slow. A test-only library (CMake target ott_cuda_emu, never installed): loading it (LD_PRELOAD into a tool, or
// dlopen after ggml is loaded) registers it through ggml-cpu's test hook (ggml-cpu-ott.h); unloading it restores
// the CPU code. It reaches the ggml already loaded in the process by name and links none itself, so a preloaded
// copy never pulls a second ggml in.
#include "ggml-cpu-ott.h"
#include "ggml-ott-args.h"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

std::atomic<long> n_calls{0};
std::atomic<long> n_fused{0}; // merges that ran their layer's seal

// the emulated kernels of the op's K/V widths (every pair the build has)
const ott2_cu_ops * ops_of(const ggml_tensor * op) {
    const ggml_ott_params * p = ggml_ott_get_params(op);
    const bool kmix = (p->flags & GGML_OTT_K_MIX) != 0;
    const bool vsym = (p->flags & GGML_OTT_V_SYM) != 0;
    const ott2_cu_ops * ops = ott2_emu_find(p->kbits, p->vbits, kmix, vsym);
    if (!ops) {
        fprintf(stderr, "ott_cuda_emu: no kernels for K %d bits%s, V %d bits%s\n", p->kbits, kmix ? " mixed" : "", p->vbits,
                vsym ? " symmetric" : "");
        abort();
    }
    return ops;
}

void emu_attn_part(ggml_tensor * dst, int ith, int /*nth*/) {
    if (ith == 0) {
        ott_cu_args a = ggml_ott_cu_args(dst);
        a.part = (float *) dst->data;
        ggml_ott_cu_attn_part(ops_of(dst), &a, nullptr); // as ggml-cuda: OTT_CUDA_PART where set
        n_calls++;
    }
}

// as the CUDA dispatch (ggml-cuda-ott.cu): a merge given its layer's flags runs the layer's seal in its launch
// (the fused launcher's emulation, blocks last first), and that OTT_SEAL node then does nothing. ggml-cuda also
// asks that the launch fit one wave of the GPU; here every such merge fuses, so the graph's seals all run at
// their merges' places.
bool merge_seals(const ggml_tensor * merge) {
    return merge->op == GGML_OP_OTT_ATTN && merge->src[1] != nullptr;
}

void emu_attn(ggml_tensor * dst, int ith, int /*nth*/) {
    if (ith == 0) {
        const ggml_tensor * part = dst->src[0];
        ott_cu_args a = ggml_ott_cu_args(part); // the merge reads `part`; the seal the partials' sources
        a.part = (float *) part->data;
        a.out = (float *) dst->data;
        const ott2_cu_ops * ops = ops_of(part);
        if (merge_seals(dst)) {
            a.flags = (int32_t *) dst->src[1]->data;
            std::vector<uint16_t> scratch((size_t) 2*ops->G*a.D*a.ns*a.H);
            a.scratch = scratch.data();
            ops->attn_merge_seal(&a, nullptr);
            n_fused++;
        } else {
            ops->attn_merge(&a, nullptr);
        }
        n_calls++;
    }
}

void emu_seal(ggml_tensor * dst, int ith, int /*nth*/) {
    if (merge_seals(dst->src[0]) && dst->src[0]->src[1] == dst->src[9]) {
        return; // sealed in the merge's launch
    }
    if (ith == 0) {
        ott_cu_args a = ggml_ott_cu_args(dst);
        const ott2_cu_ops * ops = ops_of(dst);
        std::vector<uint16_t> scratch((size_t) 2*ops->G*a.D*a.ns*a.H);
        a.scratch = scratch.data();
        ops->seal(&a, nullptr);
        n_calls++;
    }
}

const ggml_ott_cpu_impl emu_impl = { emu_attn_part, emu_attn, emu_seal };

// a function of the ggml loaded in this process: in the global scope (LD_PRELOAD), else in any loaded object
// (ggml opened with RTLD_LOCAL, e.g. by ctypes)
void * find(const char * name) {
    if (void * f = dlsym(RTLD_DEFAULT, name)) {
        return f;
    }
    std::vector<std::string> loaded;
    dl_iterate_phdr([](dl_phdr_info * info, size_t, void * data) {
        if (info->dlpi_name && info->dlpi_name[0]) {
            ((std::vector<std::string> *) data)->push_back(info->dlpi_name);
        }
        return 0;
    }, &loaded);
    for (const std::string & lib : loaded) {
        void * h = dlopen(lib.c_str(), RTLD_NOW | RTLD_NOLOAD);
        void * f = h ? dlsym(h, name) : nullptr;
        if (h) {
            dlclose(h);
        }
        if (f) {
            return f;
        }
    }
    return nullptr;
}

using set_impl_fn = void (*)(const ggml_ott_cpu_impl *);

void install(bool on) {
    const auto set_impl = (set_impl_fn) find("ggml_ott_cpu_set_impl");
    if (!set_impl) {
        if (!on) {
            return; // the process already unloaded ggml
        }
        fprintf(stderr, "ott-cuda-emu: no patched libggml-cpu/libggml-base loaded in this process\n");
        abort();
    }
    set_impl(on ? &emu_impl : nullptr);
}

} // namespace

__attribute__((constructor)) static void ott_cuda_emu_load() {
    install(true);
    fprintf(stderr, "ott-cuda-emu: ggml-cpu runs the CUDA kernels' emulation\n");
}

__attribute__((destructor)) static void ott_cuda_emu_unload() {
    install(false);
    fprintf(stderr, "ott-cuda-emu: %ld emulated ott2 ops, %ld merges with their seal\n", n_calls.load(), n_fused.load());
}
