#!/usr/bin/env bash
# Session 45. A: #35's PTQ sweep on the GPU (search batches and calibration-set spread, t and c), with the t recipe
# run to the end; B: #36 on the host's CPU alone (cpu_deploy with OpenVINO 2026.4.1, the -avx2 graphs, the fine-tuned t).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R
T=/tmp/tree; W=/tmp/weights; D=/tmp/data/coco-qat.yaml
cd $T
echo "A start $(date -u +%T)" >> $R/progress
nproc > $R/nproc.txt; lscpu > $R/lscpu.txt 2>&1; nvidia-smi > $R/nvidia-smi.txt 2>&1; python3 --version > $R/python.txt
python3 -c "import openvino, onnxruntime; print(openvino.__version__, onnxruntime.__version__)" > $R/versions.txt 2>&1
run() {  # name weights flags...
  local name=$1 w=$2; shift 2
  python3 qat.py quantize --weights $W/$w --data $D --device 0 --workers 4 --seed 57 --project /tmp/sw --name $name \
     --exist-ok "$@" 2>&1 | python3 /tmp/gpu/ts.py > $R/ts-$name.log
  cp /tmp/sw/$name/report.json $R/report-$name.json 2>/dev/null
  echo "A $name done $(date -u +%T)" >> $R/progress
}
jobs_list=(
 "t-recipe yolov9-t-coco.pt --search-layers 0-5 --lr 1e-5"
)
for m in t c; do
  w=yolov9-t-coco.pt; [ $m = c ] && w=gelan-c-coco334.pt
  P="--ptq-only --no-eval-origin"
  jobs_list+=("$m-def $w $P" "$m-s05 $w $P --search-layers 0-5"
    "$m-def-hb8 $w $P --head-batches 8" "$m-s05-hb8 $w $P --search-layers 0-5 --head-batches 8"
    "$m-s05-hb16 $w $P --search-layers 0-5 --head-batches 16"
    "$m-def-cb20 $w $P --calib-batches 20" "$m-s05-cb20 $w $P --search-layers 0-5 --calib-batches 20"
    "$m-def-cb30 $w $P --calib-batches 30" "$m-s05-cb30 $w $P --search-layers 0-5 --calib-batches 30")
done
for j in "${jobs_list[@]}"; do
  while [ $(jobs -rp | wc -l) -ge 4 ]; do wait -n; done
  run $j &
  sleep 2
done
wait
echo "A done $(date -u +%T)" >> $R/progress
# B: the CPU alone
uptime > $R/uptime-B-before.txt
C=/tmp/cpu16
python3 /tmp/repo/benchmarks/cpu_deploy.py --model c=$W/gelan-c-coco334.pt --model t=$W/yolov9-t-coco.pt --data $D \
   --imgsz 640 --device 0 --threads 16 --runs 7 --warmup 2 --out $C 2>&1 | python3 /tmp/gpu/ts.py > $R/cpu-deploy.log
cp $C/cpu-deploy.* $R/ 2>/dev/null
echo "B deploy done $(date -u +%T)" >> $R/progress
for m in t c; do
  ls $C/$m >> $R/ls-cpu16-$m.txt
  p=$(ls $C/$m/ptq_*.pt | head -1)
  python3 export_qat.py --weights $p --include onnx --dynamic --openvino-avx2 > $R/export-avx2-$m.log 2>&1
done
python3 scripts/benchmark_cpu.py --model c $C/c/c-fp32.onnx $C/c/ptq_gelan-c-coco334-avx2.onnx \
   --model t $C/t/t-fp32.onnx $C/t/ptq_yolov9-t-coco-avx2.onnx --runtime openvino --batch 1 8 --threads 16 \
   --runs 7 --warmup 2 --out $R/avx2-16core > $R/avx2-16core.log 2>&1
echo "B avx2 bench done $(date -u +%T)" >> $R/progress
q=$(ls /tmp/sw/t-recipe/weights/qat_best_*.pt | head -1)
python3 export_qat.py --weights $q --include onnx --dynamic --openvino-avx2 > $R/export-ft-t.log 2>&1
g=${q%.pt}
for graph in $g.onnx $g-avx2.onnx; do
  for b in openvino onnxruntime; do
    tag=$(basename $graph .onnx)-$b
    python3 val_trt.py --onnx $graph --backend $b --data $D --device cpu --batch-size 8 --workers 4 \
       --project /tmp/vt --name $tag --exist-ok > $R/val-$tag.log 2>&1
    cp /tmp/vt/$tag/*.json $R/ 2>/dev/null; for f in /tmp/vt/$tag/*.json; do cp $f $R/val-$tag-$(basename $f); done
    echo "B $tag done $(date -u +%T)" >> $R/progress
  done
done


uptime > $R/uptime-B-after.txt
echo "all done $(date -u +%T)" >> $R/progress
