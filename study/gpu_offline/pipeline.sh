#!/bin/bash
# On the GPU machine, in the background: what `make gpu-test` does, with no network (bundle.sh brought the
# inputs): CUDA build for this GPU, the GPU tests (each group in its own pytest, so that a crash hides nothing
# else), ott2/q4_0 KL divergence against f16 on the GPU and on the CPU through llama-perplexity, the benchmark.
W=/tmp/ott
export OTT_GGUF_CACHE=$W/cache/ott-gguf PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
       CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
cd $W/repo
log() { echo "== $(date +%T) $*"; }
log env; nvidia-smi -L; nvcc --version | tail -1; cmake --version | head -1; python3 --version; nproc
python3 -m pip install -q --no-index --no-deps .gpu-bundle/whl/*.whl
SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); cp -r .gpu-bundle/py/llama_cpp "$SP"/
log build
# the architectures: CMakeLists.txt's default (the visible GPU's) unless CUDA_ARCH names others
time python3 -m pip install --no-index --no-deps --no-build-isolation -Ccmake.define.OTT_GGUF_CUDA=ON \
  ${CUDA_ARCH:+-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH} -Ccmake.define.OTT_GGUF_VULKAN=OFF \
  -Cbuild-dir=$W/build . > $W/build-full.log 2>&1
rc=$?; tail -3 $W/build-full.log
[ $rc = 0 ] || { tail -60 $W/build-full.log; log build failed; touch $W/done; exit 1; }
log waiting for the model
for _ in $(seq 900); do [ -f $W/model.ready ] && break; sleep 1; done
M=$OTT_GGUF_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf
B=$(cd / && python3 -c 'import ott_gguf._lib as l; print(l.bin_path("llama-bench").parent)')
cd tests
PT="python3 -m pytest -q -rs -s -p no:cacheprovider"
log "a copy of libstdc++ inside libggml-cuda? (the test, then the library's link line)"
timeout 60 $PT test_gpu.py -k libstdcxx 2>&1 | tail -4
(cd $W/build && ninja -t commands "$(ninja -t targets all | grep -o '^[^:]*libggml-cuda\.so\.[0-9.]*[0-9]' | head -1)" \
  | tail -1 | tr ' ' '\n' | grep -v '\.o$' | grep .)
log "kernel ops on the GPU against the numpy reference"; timeout 300 $PT test_cuda_emu.py -k on_gpu 2>&1 | tail -20
log "op placement"; timeout 300 $PT test_gpu.py -k "run_where and smollm2" 2>&1 | tail -20
for kv in f16 q8_0 q4_0 ott2; do
  log "GPU vs CPU logits, $kv"; timeout 300 $PT test_gpu.py -k "logits and $kv" 2>&1 | tail -12
done
log "greedy generation"; timeout 300 $PT test_gpu.py -k greedy 2>&1 | tail -16
log "where an in-process load crashes: its native backtrace"
timeout 240 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex "bt 20" --args $PT test_gpu.py -k "logits and f16" 2>&1 \
  | grep -A22 "received signal" | head -24
cd ..
log "KL divergence against f16 on the GPU (-ngl 99) and the CPU (-ngl 0)"
D=$(echo $OTT_GGUF_CACHE/llama.cpp-*/docs); cat $D/build.md $D/function-calling.md $D/multimodal.md > $W/text.txt
for ngl in 99 0; do
  $B/llama-perplexity -m $M -f $W/text.txt -c 512 --chunks 8 -ngl $ngl -t $(nproc) --kl-divergence-base $W/base$ngl.kld \
    2>&1 | grep "Final estimate"
  for kv in ott2 q4_0; do
    echo "-ngl $ngl $kv:"; timeout 300 $B/llama-perplexity -m $M -f $W/text.txt -c 512 --chunks 8 -ngl $ngl -t $(nproc) \
      -ctk $kv -ctv $kv -fa on --kl-divergence-base $W/base$ngl.kld --kl-divergence 2>&1 | grep -E "Mean    KLD|Same top p"
  done
done
log bench
timeout 900 python3 -m study.gpu_check --skip-tests --out $W/benchmarks-gpu.md 2>&1 | grep -v "^load\|^print_info\|^llama_model_load" | tail -24
log done; touch $W/done
