#!/bin/bash
# Builds ott-bench (native/tests/ott-bench.cu, docs/cuda-harness.md), the ott2 CUDA ops timed alone, from the same
# generated sources as the llama.cpp build, without a GPU: SASS for each architecture named and PTX of the last (a
# newer GPU JIT-compiles it). ptxas's resource report (registers, stack, spills, shared memory per kernel and
# architecture) is kept next to the binary. The kernels' CPU emulation is linked in too (ott-bench --emu: the
# harness's state and checks run without a GPU).
#   bash native/tests/build-ott-bench.sh [OUT (build/cuda-bench)] [ARCHS ("75 80 86 89 90")]
# NVCC: the nvcc command (the tests pass their compiler cache: python tests/tool_cache.py nvcc)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/build/cuda-bench}
ARCHS=${2:-75 80 86 89 90}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
# the head configs ott-bench.cu includes: ott2 (-ctk ott2 -ctv ott2: 2-bit keys of mixed widths), ott2u (uniform 2-bit
# keys, k_mix 1) and the quality tier's (docs/tiers.md)
G=$OUT/gen
"$PY" gen/generate.py cuda --out "$G" --cuda-heads 2m/2:128:64,2:128:64,3m/2s:128:64
# the floating-point flags of the CUDA build's ott units: ggml-cuda's -use_fast_math, then CMakeLists.txt's
# OTT_CUDA_FLAGS (IEEE again where the state is written), so the harness times what users run
read -r -a FPFLAGS <<< "-use_fast_math $(sed -n 's/^set(OTT_CUDA_FLAGS \(.*\))$/\1/p' CMakeLists.txt)"
[ "${#FPFLAGS[@]}" -gt 1 ] || { echo "build-ott-bench.sh: no OTT_CUDA_FLAGS in CMakeLists.txt" >&2; exit 1; }
GENCODE=()
for a in $ARCHS; do GENCODE+=(-gencode "arch=compute_$a,code=sm_$a"); done
GENCODE+=(-gencode "arch=compute_${ARCHS##* },code=compute_${ARCHS##* }")
# OTT_SWEEP_<tag>: ott2's unit also compiles the partials' other instances (ott-bench --sweep)
if ! ${NVCC:-nvcc} -O3 -std=c++17 "${FPFLAGS[@]}" "${GENCODE[@]}" -Xptxas -v -Werror all-warnings -DOTT_SWEEP_k2mv2g128x64 -I "$G" native/tests/ott-bench.cu \
     "$G/ott2-emu-k2mv2g128x64.cpp" "$G/ott2-emu-k2v2g128x64.cpp" "$G/ott2-emu-k3mv2sg128x64.cpp" -o "$OUT/ott-bench" \
     2> "$OUT/ott-bench.ptxas.txt"; then
  grep -v "^ptxas info\|^    [0-9]* bytes stack" "$OUT/ott-bench.ptxas.txt" | tail -40 >&2
  echo "build-ott-bench.sh: nvcc failed" >&2
  exit 1
fi
echo "$OUT/ott-bench: $(stat -c %s "$OUT/ott-bench") bytes, sm_${ARCHS// /,sm_} (ptxas: $OUT/ott-bench.ptxas.txt)"
