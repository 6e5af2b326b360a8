#!/bin/bash
# On the GPU machine (first call): unpack, then build and test in a background session that outlives the call.
W=/tmp/ott; rm -rf $W; mkdir -p $W/cache/ott-gguf/models
mv .gpu-bundle/model.part00 $W/ && tar -C $W/cache/ott-gguf -xJf .gpu-bundle/src.tar.xz && cp -a . $W/repo || exit 1
setsid nohup bash $W/repo/.gpu-bundle/pipeline.sh > $W/pipeline.log 2>&1 < /dev/null &
sleep 20; cat $W/pipeline.log
