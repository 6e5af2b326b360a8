#!/bin/bash
# On the GPU machine, in the background: what `make gpu-test` does, with no network (bundle.sh brought the
# inputs), most important first, since a lease can end before the last step: the kernel harness ott-bench (under a
# minute, before the build: where the ott ops' time goes, docs/cuda-harness.md) and its sweep (which instance of the
# partials is fastest, and a prefill ubatch's); the kernels against the numpy
# reference (the test library bundle.sh built, beside the build); the CUDA build for this GPU; ott2's logits on
# the GPU against the CPU's and op placement (in process, each group in its own pytest, so that a crash hides
# nothing else); decode speed, f16 and ott2 interleaved, on SmolLM2 and on the 8B shape (study.random_gguf,
# written during the build) at depths 4096 and 32768; ncu sections of the harness's partials; the other
# cache types' logits, KL divergence against f16 on the GPU, the libstdc++ check, greedy generation, the native
# backtrace of an in-process run that crashed; the whole benchmark (study.gpu_check) only where FULL_BENCH is set.
W=/tmp/ott
export OTT_GGUF_CACHE=$W/cache/ott-gguf PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
       CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
cd $W/repo
log() { echo "== $(date +%T) $*"; }
log env; nvidia-smi -L; nvcc --version | tail -1; cmake --version | head -1; python3 --version; nproc
# whether the ott ops could also run through Vulkan here (no Vulkan GPU has run them: docs/vulkan-ops.md): the
# driver's ICD files, the loader, glslc; a second's look, for a later pass to plan on
log "vulkan: ICDs, loader, glslc"; ls /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>&1 | tr '\n' ' '; echo
ldconfig -p | grep -i libvulkan | head -2; command -v glslc vulkaninfo || echo "no glslc or vulkaninfo"
log "ott-bench: the ott2 CUDA ops alone on random state (docs/cuda-harness.md)"
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
[ -f .gpu-bundle/ott-bench.xz ] && xz -dc .gpu-bundle/ott-bench.xz > $W/ott-bench && chmod +x $W/ott-bench
# bundled for sm_90 (bundle.sh BENCH_ARCH) with compute_90 PTX for newer GPUs: an older one gets its own build
if [ ! -x $W/ott-bench ] || { [ "$CAP" -lt 90 ] && ! cuobjdump --list-elf $W/ott-bench 2>/dev/null | grep -q "sm_$CAP"; }; then
  log "ott-bench built here for sm_$CAP (not bundled, or not for this GPU)"
  bash native/tests/build-ott-bench.sh $W/bench "$CAP" | tail -1 && cp $W/bench/ott-bench $W/
fi
timeout 90 $W/ott-bench; echo "ott-bench rc=$?"
log "ott-bench --sweep: the partials' instances and slice counts, decode and a prefill ubatch (docs/cuda-harness.md)"
timeout 90 $W/ott-bench --sweep | tee $W/sweep.log; echo "ott-bench --sweep rc=${PIPESTATUS[0]}"
python3 -m pip install -q --no-index --no-deps .gpu-bundle/whl/*.whl
SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); cp -r .gpu-bundle/py/llama_cpp "$SP"/
PT="python3 -m pytest -q -rs -s -p no:cacheprovider"
# the kernels against the numpy reference, on one core beside the build (the package from source: no native
# library is needed), with the test library bundle.sh built (call 2 brings it: call 1 is near 64 MiB); run again
# after the build when it did not get as far as a test result. Then the sanitizers, 4 minutes at most, ended
# after the build at the latest (they must not share the GPU with the timings)
(for _ in $(seq 300); do [ -f $W/cuda-testlib.xz ] && break; sleep 1; done
 xz -dc $W/cuda-testlib.xz > $W/libott_cuda_test.so || exit
 mkdir -p $W/no-native/lib  # the package from source, whose tests/conftest.py wants a native directory: an empty one
 cd tests && export OTT_CUDA_TESTLIB=$W/libott_cuda_test.so PYTHONPATH=$W/repo OTT_GGUF_NATIVE_DIR=$W/no-native
 timeout 300 $PT test_cuda_emu.py -k on_gpu
 # shared-memory races and barrier misuse, which the emulation (lanes and threads one after another) cannot show:
 # the first launches of the decode harness and of the reference tests (prefill rows included), checked
 CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
 for tool in racecheck synccheck; do
   echo "== compute-sanitizer --tool $tool: ott-bench smol 4096 ott2 (12 launches), test_cuda_emu on_gpu (60)"
   timeout 60 $CS --tool $tool --launch-count 12 $W/ott-bench smol 4096 ott2 2>&1 | grep -E "SUMMARY|azard|arrier" | head -6
   timeout 60 $CS --tool $tool --launch-count 60 $PT test_cuda_emu.py -k on_gpu -x 2>&1 \
     | grep -E "SUMMARY|azard|arrier|passed|failed" | head -6
 done) > $W/on-gpu.log 2>&1 &
ONGPU=$!
# Llama-3-8B's shape with random Q4_0 weights (4.3 GiB, ~15 s of one core: written here, not carried), while the
# build takes the other cores; the 8B decode step waits for it
log "the 8B-shaped model, in the background: python3 -m study.random_gguf --shape llama3-8b"
(python3 -m study.random_gguf --shape llama3-8b --out $W/llama3-8b.gguf; echo "random_gguf rc=$?") \
  > $W/random-gguf.log 2>&1 &
log build
# the architectures: CMakeLists.txt's default (the visible GPU's) unless CUDA_ARCH names others
# a tuning build (OTT_GGUF_CUDA_SWEEP): the decode step also times the model with the sweep's fastest partials
time python3 -m pip install --no-index --no-deps --no-build-isolation -Ccmake.define.OTT_GGUF_CUDA=ON \
  -Ccmake.define.OTT_GGUF_CUDA_SWEEP=ON \
  ${CUDA_ARCH:+-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH} -Ccmake.define.OTT_GGUF_VULKAN=OFF \
  -Cbuild-dir=$W/build . > $W/build-full.log 2>&1
rc=$?; tail -3 $W/build-full.log
[ $rc = 0 ] || { tail -60 $W/build-full.log; log build failed; touch $W/done; exit 1; }
log "kernels against the numpy reference (test_cuda_emu.py -k on_gpu, started before the build)"
for _ in $(seq 60); do kill -0 $ONGPU 2>/dev/null || break; sleep 1; done
pkill -f compute-sanitizer; wait $ONGPU; tail -20 $W/on-gpu.log
if [ -f $W/libott_cuda_test.so ] && ! grep -qE "[0-9]+ (passed|failed)" $W/on-gpu.log; then
  (cd tests && OTT_CUDA_TESTLIB=$W/libott_cuda_test.so timeout 240 $PT test_cuda_emu.py -k on_gpu 2>&1 | tail -12)
fi
log waiting for the model
for _ in $(seq 900); do [ -f $W/model.ready ] && break; sleep 1; done
M=$OTT_GGUF_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf
B=$(cd / && python3 -c 'import ott_gguf._lib as l; print(l.bin_path("llama-bench").parent)')
cd tests
crashed=""
log "GPU vs CPU logits, ott2 (in process)"; timeout 180 $PT test_gpu.py -k "logits and ott2" 2>&1 | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || crashed="logits and ott2"
log "where ott2's GPU logits leave the CPU's: per position, by variant (study/gpu_offline/logits_probe.py)"
(cd .. && timeout 150 python3 -m study.gpu_offline.logits_probe 2>&1 | grep -v "^llama\|^load\|^print_info"
 for sw in GGML_CUDA_DISABLE_FUSION=1 GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 GGML_CUDA_DISABLE_GRAPHS=1; do
   env $sw timeout 60 python3 -m study.gpu_offline.logits_probe --only ott2 2>&1 | grep "^ott2"
 done)
log "the first tensor where they part: layers 0-1 of the first ubatch through the eval callback (tensor_probe.py)"
(cd .. && for kv in ott2 q8_0; do timeout 60 python3 -m study.gpu_offline.tensor_probe --kv $kv 2>&1 \
   | grep -v "^llama\|^load\|^print_info"; done)
log "op placement"; timeout 150 $PT test_gpu.py -k "run_where and smollm2" 2>&1 | tail -8
cd ..
# decode: llama-bench -fa 1 -p 0 -n N -d D -r 1 -ngl 99 per round and type, f16 and ott2 interleaved, and ott2
# "tuned" where the sweep found partials faster than the launcher's (study/gpu_offline/sweep_pick.py: the tuning
# knobs OTT_CUDA_PART and OTT_SLICE_GROUPS, docs/cuda-harness.md "Tuning builds"); a run that fails or passes 100 s
# ends its depth (the deeper one would too)
bench() {  # model label depth rounds n harness-shape
  local tune
  if tune=$(python3 -m study.gpu_offline.sweep_pick --shape $6 --depth $3 $W/sweep.log 2>&1); then
    echo "$2 d$3: tuning knobs for the sweep's fastest partials: ${tune:-none, the launcher is as fast}"
  else
    echo "$2 d$3: no tuned arm: $tune"; tune=""
  fi
  for r in $(seq $4); do
    for arm in f16 ott2 ${tune:+tuned}; do
      kv=${arm/tuned/ott2}
      res=$(env $([ $arm = tuned ] && echo $tune) timeout 100 $B/llama-bench -m $1 -ctk $kv -ctv $kv -fa 1 -p 0 \
        -n $5 -d $3 -r 1 -ngl 99 2>/dev/null | grep "tg$5")
      echo "$2 d$3 round $r $arm: ${res:-no tg$5 row (failed, or past 100 s)}"
      # a tuned run that fails drops its arm; f16's or ott2's ends the depth (the deeper one would fail too)
      [ -n "$res" ] || { [ $arm = tuned ] && tune="" && continue; return 1; }
    done
  done
}
log "decode, SmolLM2: depth 4096 (3 rounds of tg64), 32768 (2 rounds of tg32)"
bench $M smol 4096 3 64 smol; bench $M smol 32768 2 32 smol
log "decode, the 8B shape (random Q4_0 weights, 32 layers): depth 4096 (2 rounds of tg32), 32768 (1 round)"
wait; cat $W/random-gguf.log  # the model writer started before the build
bench $W/llama3-8b.gguf 8b 4096 2 32 llama8b && bench $W/llama3-8b.gguf 8b 32768 1 32 llama8b
# prefill at depth (the 8B shape's 32k ott2 prefill passed 100 s on 2026-11-30): pp512 after 4096 tokens, one round
log "prefill: pp512 at depth 4096, f16 and ott2, both models (1 round)"
for m in "$M smol" "$W/llama3-8b.gguf 8b"; do
  set -- $m
  for kv in f16 ott2; do
    res=$(timeout 60 $B/llama-bench -m $1 -ctk $kv -ctv $kv -fa 1 -p 512 -n 0 -d 4096 -r 1 -ngl 99 2>/dev/null | grep pp512)
    echo "$2 d4096 $kv: ${res:-no pp512 row (failed, or past 60 s)}"
  done
done
log "where a decoded token's GPU time goes, by kernel: nsys over tg32 at depth 4096, SmolLM2, f16 and ott2"
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [ -n "$NSYS" ]; then
  for kv in f16 ott2; do
    timeout 90 $NSYS profile -t cuda --cuda-graph-trace=node -f true -o $W/nsys-$kv $B/llama-bench -m $M -ctk $kv \
      -ctv $kv -fa 1 -p 0 -n 32 -d 4096 -r 1 -ngl 99 > $W/nsys-$kv.log 2>&1; echo "nsys $kv rc=$?"
    timeout 60 $NSYS stats -r cuda_gpu_trace -f csv -o $W/nsys-$kv $W/nsys-$kv.nsys-rep > /dev/null 2>&1
  done
  timeout 30 python3 -m study.gpu_offline.decode_kernels --tokens 32 f16=$W/nsys-f16_cuda_gpu_trace.csv \
    ott2=$W/nsys-ott2_cuda_gpu_trace.csv
else echo "no nsys on this machine"; fi
log "ncu: the partials of the harness at depth 4096, both shapes (occupancy, stalls, instructions, memory)"
# over llama-bench the first 2400 launches were all the depth's prefill: the harness's decode launch instead
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for shape in smol llama8b; do
  timeout 60 $NCU --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis -k regex:attn_part -c 1 \
    $W/ott-bench $shape 4096 ott2 > $W/ncu-$shape.txt 2>&1
  echo "ncu $shape rc=$?"; grep -E "^    (Duration|Registers Per|Achieved Occ|Warp Cycles Per Issued|Executed Inst|Grid Size)" \
    $W/ncu-$shape.txt
done
# the sealing event (150 us at smol 4096 on the H200, 130-200 elsewhere: once per 128 tokens and layer at decode, but
# once per layer in every 128-token prefill ubatch): the first launch of the seal after the decode seal row's 470
# (docs/cuda-harness.md "The next minutes")
timeout 60 $NCU --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
  --section InstructionStats -k regex:k2mv2g128x64_seal --launch-skip 470 -c 1 $W/ott-bench smol 4096 ott2 \
  > $W/ncu-seal-event.txt 2>&1
echo "ncu sealing event rc=$?"; grep -E "^    (Duration|Registers Per|Achieved Occ|Warp Cycles Per Issued|Executed Inst)" \
  $W/ncu-seal-event.txt
log "KL divergence against f16 on the GPU (-ngl 99)"
D=$(echo $OTT_GGUF_CACHE/llama.cpp-*/docs); cat $D/build.md $D/function-calling.md $D/multimodal.md > $W/text.txt
$B/llama-perplexity -m $M -f $W/text.txt -c 512 --chunks 8 -ngl 99 -t $(nproc) --kl-divergence-base $W/base.kld \
  2>&1 | grep "Final estimate"
for kv in ott2 q4_0; do
  echo "$kv:"; timeout 120 $B/llama-perplexity -m $M -f $W/text.txt -c 512 --chunks 8 -ngl 99 -t $(nproc) \
    -ctk $kv -ctv $kv -fa on --kl-divergence-base $W/base.kld --kl-divergence 2>&1 | grep -E "Mean    KLD|Same top p"
done
cd tests
log "batch invariance on the GPU: test_same_answer.py's split modes, OTT_TEST_NGL=99"
OTT_TEST_NGL=99 timeout 240 $PT test_same_answer.py -k "batching or split_modes" 2>&1 | grep -E "max \||passed|failed"
for kv in f16 q4_0; do
  log "GPU vs CPU logits, $kv (in process)"; timeout 180 $PT test_gpu.py -k "logits and $kv" 2>&1 | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || crashed="${crashed:-logits and $kv}"
done
log "a copy of libstdc++ exported by any library?"; timeout 120 $PT test_build.py -k libstdcxx 2>&1 | tail -4
log "greedy generation (in process)"; timeout 180 $PT test_gpu.py -k greedy 2>&1 | tail -6
if [ -n "$crashed" ]; then
  log "where the in-process run of '$crashed' failed: its native backtrace, if it crashed"
  timeout 180 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex "bt 20" --args $PT test_gpu.py -k "$crashed" \
    2>&1 | grep -A22 "received signal" | head -24
fi
cd ..
log bench; [ -n "$FULL_BENCH" ] && timeout 600 python3 -m study.gpu_check --skip-tests --out $W/benchmarks-gpu.md 2>&1 \
  | grep -v "^load\|^print_info\|^llama_model_load" | tail -24
log done; touch $W/done
