#!/bin/bash
# On the GPU machine (next calls, while it is warm): joins the model's halves, waits up to WAIT seconds for the
# pipeline, copies its logs and docs/benchmarks-gpu.md to $OUT.
W=/tmp/ott
[ -d $W/repo ] || { echo "COLD: the first call's machine is gone"; exit 3; }
if [ -f .gpu-bundle/model.part01 ] && [ -f $W/model.part00 ]; then
  M=$W/cache/ott-gguf/models/SmolLM2-135M-Instruct.Q4_1.gguf
  cat $W/model.part00 .gpu-bundle/model.part01 > $M.tmp && mv $M.tmp $M && rm $W/model.part00 && touch $W/model.ready
fi
# the CUDA test library (bundle.sh), which the pipeline waits for beside the build
[ -f .gpu-bundle/cuda-testlib.xz ] && cp .gpu-bundle/cuda-testlib.xz $W/t.xz && mv $W/t.xz $W/cuda-testlib.xz
end=$((SECONDS + ${WAIT:-500}))
while [ ! -f $W/done ] && [ $SECONDS -lt $end ]; do sleep 5; done
cp $W/pipeline.log $W/on-gpu.log $W/build-full.log $W/benchmarks-gpu.md $W/ncu-*.txt $W/sweep.log $OUT/ 2>/dev/null
[ -f $W/done ] && echo PIPELINE-DONE || echo PIPELINE-RUNNING
tail -c 10000 $W/pipeline.log
