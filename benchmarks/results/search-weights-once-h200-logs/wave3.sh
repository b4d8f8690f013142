#!/usr/bin/env bash
# The amax search with the weights quantized once (new) against the code before it (old), GELAN-C, one after the other.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=/tmp/results3; mkdir -p $R; W=/tmp/weights; D=/tmp/data/coco-qat.yaml
rm -rf /tmp/tree-old && cp -a /tmp/tree /tmp/tree-old && cp /tmp/gpu/old/head.py /tmp/tree-old/utils/qat/quantize/head.py
for v in new old; do
  T=/tmp/tree; [ $v = old ] && T=/tmp/tree-old
  cd $T
  python3 qat.py quantize --weights $W/gelan-c-coco334.pt --data $D --device 0 --workers 8 --ptq-only --no-eval-origin \
     --search-layers 0-5 --project /tmp/s3 --name $v --exist-ok 2>&1 | python3 /tmp/gpu/ts.py > $R/ts-c-search-$v.log
  echo "$v done $(date -u +%T)" >> $R/progress
done
echo "all done" >> $R/progress
