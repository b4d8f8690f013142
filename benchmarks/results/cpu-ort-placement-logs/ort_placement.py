"""Does an INT8 graph that ONNX Runtime can fuse run faster than the FP32 graph on its CPU provider? ONNX Runtime's
own static quantizer (a QuantizeLinear after every quantizable op, so each Conv, Sigmoid and Mul becomes a QLinear
op or fuses as one) in its QOperator and QDQ formats, on an FP32 graph of export_qat.py, against the same FP32
graph and the toolkit's TensorRT-placement INT8 graph; speed only (batch 1, 640 px, 2 threads, 2 warm-ups, 7
alternating rounds). Calibrated on the first 8 coco369 images. See ../cpu-ort-placement-2core.md.

    python3 ort_placement.py FP32.onnx TOOLKIT_INT8.onnx IMAGES_DIR OUT_DIR
"""
import glob
import sys
import time

import cv2
import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

fp32, toolkit, images, out = sys.argv[1:5]


def letterbox(path):
    im = cv2.imread(path)
    r = 640 / max(im.shape[:2])
    im = cv2.resize(im, (round(im.shape[1] * r), round(im.shape[0] * r)))
    canvas = np.full((640, 640, 3), 114, np.uint8)
    canvas[:im.shape[0], :im.shape[1]] = im
    return np.ascontiguousarray(canvas[:, :, ::-1].transpose(2, 0, 1)[None], np.float32) / 255


batches = [letterbox(p) for p in sorted(glob.glob(f"{images}/*.jpg"))[:8]]


class Reader(CalibrationDataReader):
    def __init__(self):
        self.batches = iter(batches)

    def get_next(self):
        x = next(self.batches, None)
        return None if x is None else {"images": x}


graphs = {"FP32": fp32}
for fmt in ("QOperator", "QDQ"):
    graphs[f"ONNX Runtime's INT8, {fmt}"] = f"{out}/ort-{fmt}.onnx"
    quantize_static(fp32, graphs[f"ONNX Runtime's INT8, {fmt}"], Reader(), quant_format=getattr(QuantFormat, fmt),
                    per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
graphs["the toolkit's INT8 (TensorRT placement)"] = toolkit
opts = ort.SessionOptions()
opts.intra_op_num_threads = 2
opts.inter_op_num_threads = 1
sessions = {k: ort.InferenceSession(p, opts, providers=["CPUExecutionProvider"]) for k, p in graphs.items()}
times = {k: [] for k in sessions}
for s in sessions.values():
    for _ in range(2):
        s.run(None, {"images": batches[0]})
for _ in range(7):
    for k, s in sessions.items():
        t = time.perf_counter()
        s.run(None, {"images": batches[0]})
        times[k].append(time.perf_counter() - t)
print("| graph | median ms (p10-p90) | speed-up over FP32 |\n|---|---:|---:|")
for k, v in times.items():
    print(f"| {k} | {1000 * np.median(v):.1f} ({1000 * np.percentile(v, 10):.1f}-{1000 * np.percentile(v, 90):.1f}) | "
          f"{np.median(times['FP32']) / np.median(v):.2f}x |")
for fmt in ("QOperator", "QDQ"):
    ops = {}
    for n in onnx.load(f"{out}/ort-{fmt}.onnx").graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    print(fmt, dict(sorted(ops.items(), key=lambda kv: -kv[1])[:8]))
