#!/bin/bash
# Prepares what `make gpu-test` needs on an NVIDIA machine that reaches no network (the device tool's machines):
# the pinned llama.cpp tree unpacked and pruned (the build takes it instead of the sdist), the pure-Python
# llama_cpp layer, wheels of the few test dependencies such an image lacks (and of gguf and PyYAML, with which
# study.random_gguf writes the 8B-shaped model there), and SmolLM2 in two halves (one call carries at most 64 MiB). Run here, after `make install models`; then see docs/gpu-offline.md.
#   bash study/gpu_offline/bundle.sh [PYTHON_VERSION_ON_THE_GPU_MACHINE (3.12)]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV=${1:-3.12}
OUT=.gpu-bundle
CACHE=${OTT_GGUF_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ott-gguf}
SHA=$(sed -n 's/^set(OTT_LCP_SHA256 *"\([0-9a-f]*\)")/\1/p' CMakeLists.txt)
TREE=llama.cpp-${SHA:0:16}
[ -f "$CACHE/$TREE/.ott-pristine" ] || { echo "no unpacked llama.cpp in $CACHE: run make install first" >&2; exit 1; }
MODEL=$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || { echo "no $MODEL: run make models first" >&2; exit 1; }
rm -rf $OUT && mkdir -p $OUT/whl $OUT/py
# the build needs ggml (CPU, CUDA, RPC, Vulkan for its patches), src, common, tools, vendor; tests read docs/*.md
EXCL=(models benches media app pocs examples conversion gguf-py tools/ui/tests)
for b in cann hexagon metal musa opencl openvino sycl webgpu zdnn zendnn virtgpu et hip blas; do EXCL+=(ggml/src/ggml-$b); done
tar -C "$CACHE" -cf - "${EXCL[@]/#/--exclude=$TREE/}" --exclude="$TREE/docs/**/*.png" --exclude="$TREE/docs/*.png" \
    --exclude="$TREE/docs/**/*.jpg" --exclude="$TREE/docs/**/*.gif" "$TREE" | xz -T0 -6 > $OUT/src.tar.xz
SITE=$(.venv/bin/python -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')
cp -r "$SITE" $OUT/py/ && find $OUT/py -name __pycache__ -prune -exec rm -rf {} +
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d $OUT/whl "cffi==2.0.0" "pycparser==2.23" "diskcache==5.6.3" "gguf==0.19.0" "PyYAML==6.0.2"
half=$(( ($(stat -c %s "$MODEL") + 1) / 2 ))
split -b "$half" -d "$MODEL" $OUT/model.part
cp study/gpu_offline/*.sh $OUT/
# the kernel harness (docs/cuda-harness.md), which pipeline.sh runs first, for the GPU's architecture (BENCH_ARCH,
# default 90: the H100/H200; its PTX serves newer ones), compressed (about 7 MB to 1.8 MB: call 1 is close to 64 MiB).
# Without nvcc here, pipeline.sh builds it on the GPU machine.
if command -v nvcc > /dev/null; then
  bash native/tests/build-ott-bench.sh build/cuda-bench "${BENCH_ARCH:-90}" && xz -9 -c build/cuda-bench/ott-bench > $OUT/ott-bench.xz
  # the CUDA test library of tests/test_cuda_emu.py (its head configs, OTT_CU_TEST_API) for the GPU's architecture
  # (TESTLIB_ARCH, default 90: the H100/H200), a unit per head config compiled in parallel: pipeline.sh runs the
  # kernels against the numpy reference with it (OTT_CUDA_TESTLIB) while the build runs
  T=build/cuda-testlib; rm -rf $T && mkdir -p $T
  HEADS=$(cd tests && ../.venv/bin/python -c 'from test_cuda_emu import HEADS; from cuda_ops import head_spec
print(",".join(head_spec(*h) for h in HEADS))')
  .venv/bin/python gen/generate.py cuda --out $T --cuda-heads "$HEADS"
  ls $T/ott2-cuda-*.cu | xargs -P "$(nproc)" -I{} nvcc -c -O3 -std=c++17 -arch=sm_${TESTLIB_ARCH:-90} \
    -DOTT_CU_TEST_API -Xcompiler -fPIC -I $T {} -o {}.o
  nvcc -shared -arch=sm_${TESTLIB_ARCH:-90} $T/ott2-cuda-*.cu.o -o $T/libott_cuda_test.so
  xz -9 -c $T/libott_cuda_test.so > $OUT/cuda-testlib.xz
fi
du -sh $OUT/src.tar.xz $OUT/model.part00 $OUT/model.part01 $OUT/ott-bench.xz $OUT/cuda-testlib.xz 2>/dev/null || true
