#!/bin/bash
# Session 49: more GELAN-C PTQ draws for #35 (ptq-spread-h200 had 3 without the search, 4 with it): the same model,
# data and seed, with what should not matter changed (calibration batches 16 / 18 / 22, search batches 12 / 16).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R
cd /tmp/tree
nvidia-smi > $R/nvidia-smi.txt 2>&1; nproc > $R/nproc.txt
echo "start $(date -u +%T)" >> $R/progress
run() {  # name flags...
  local name=$1; shift
  python3 qat.py quantize --weights /tmp/w/gelan-c-coco334.pt --data /tmp/data/coco-qat.yaml --device 0 --workers 2 \
    --seed 57 --project /tmp/sw --name $name --exist-ok --ptq-only --no-eval-origin "$@" > $R/$name.log 2>&1
  echo "$name exit $? $(date -u +%T)" >> $R/progress
  cp /tmp/sw/$name/report.json $R/report-$name.json 2>/dev/null
}
run c-def-cb16 --search-layers none --calib-batches 16 &
run c-def-cb18 --search-layers none --calib-batches 18 &
run c-def-cb22 --search-layers none --calib-batches 22 &
run c-def-hb16 --search-layers none --head-batches 16 &
run c-s05-cb16 --search-layers 0-5 --calib-batches 16 &
run c-s05-cb18 --search-layers 0-5 --calib-batches 18 &
run c-s05-cb22 --search-layers 0-5 --calib-batches 22 &
run c-s05-hb12 --search-layers 0-5 --head-batches 12 &
wait
echo "all done $(date -u +%T)" >> $R/progress
