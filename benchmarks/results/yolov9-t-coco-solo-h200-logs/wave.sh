#!/usr/bin/env bash
# Runs on the GPU machine from /tmp (setsid). A: the t commands timed alone; B: the held-out search diagnostics;
# C: GELAN-C's CPU graphs timed on the host's 16 cores alone.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R
T=/tmp/tree; W=/tmp/weights; D=/tmp/data/coco-qat.yaml
cd $T
echo "A start $(date -u +%T)" >> $R/progress
nproc > $R/nproc.txt; lscpu > $R/lscpu.txt 2>&1; nvidia-smi > $R/nvidia-smi.txt 2>&1
for name in recipe defaults; do
  extra=""; [ $name = recipe ] && extra="--search-layers 0-5 --lr 1e-5"
  uptime > $R/uptime-$name-before.txt
  python3 qat.py quantize --weights $W/yolov9-t-coco.pt --data $D --device 0 --workers 8 --seed 57 $extra \
     --project /tmp/solo --name $name --exist-ok 2>&1 | python3 /tmp/gpu/ts.py > $R/ts-$name.log
  uptime > $R/uptime-$name-after.txt
  cp /tmp/solo/$name/report.json $R/report-$name.json 2>/dev/null
  echo "A $name done $(date -u +%T)" >> $R/progress
done
echo "B start $(date -u +%T)" >> $R/progress
python3 /tmp/gpu/search_heldout.py --weights $W/yolov9-t-coco.pt --data $D --device 0 --workers 6 --search-layers 0-5 \
   --out $R/heldout-t > $R/heldout-t.log 2>&1 &
python3 /tmp/gpu/search_heldout.py --weights $W/gelan-c-coco334.pt --data $D --device 0 --workers 6 --search-layers 0-5 \
   --out $R/heldout-c > $R/heldout-c.log 2>&1 &
# GELAN-C's PTQ checkpoint for the CPU graphs (defaults), meanwhile
python3 qat.py quantize --weights $W/gelan-c-coco334.pt --data $D --device 0 --workers 4 --ptq-only \
   --project /tmp/cq --name ptq --exist-ok > $R/c-ptq.log 2>&1
wait
echo "B done $(date -u +%T)" >> $R/progress
C=/tmp/cpu; mkdir -p $C
cp $(ls /tmp/cq/ptq/weights/ptq*.pt | head -1) $C/c-ptq.pt
cp $W/gelan-c-coco334.pt $C/c-fp.pt
python3 export_qat.py --weights $C/c-fp.pt --include onnx --dynamic > $R/export-c-fp32.log 2>&1
python3 export_qat.py --weights $C/c-ptq.pt --include onnx --dynamic --onnxruntime-cpu uint8 > $R/export-c-uint8.log 2>&1
cp $C/c-ptq-ort.onnx $C/c-ptq-ort-uint8.onnx
python3 export_qat.py --weights $C/c-ptq.pt --include onnx --dynamic --onnxruntime-cpu 7bit > $R/export-c-7bit.log 2>&1
cp $C/c-ptq-ort.onnx $C/c-ptq-ort-7bit.onnx
echo "C exported $(date -u +%T)" >> $R/progress
for g in ptq ptq-ort-uint8 ptq-ort-7bit; do
  int8=$C/c-$g.onnx
  python3 scripts/benchmark_cpu.py --model c $C/c-fp.onnx $int8 --runtime onnxruntime --batch 1 8 \
     --out $R/cpu-16core-c-$g > $R/cpu-16core-c-$g.log 2>&1
  echo "C $g done $(date -u +%T)" >> $R/progress
done
echo "all done $(date -u +%T)" >> $R/progress
