"""Batch-1 latency of ONNX graphs on ONNX Runtime's CPU provider, 2 threads: 2 warm-ups, then 7 rounds alternating
between the graphs; median (p10-p90) and the speed-up over the first graph.

    python3 ort_time.py FP32=fp32.onnx "TensorRT graph=int8.onnx" "derived placement=ort.onnx"
"""
import sys
import time

import numpy as np
import onnxruntime as ort

opts = ort.SessionOptions()
opts.intra_op_num_threads = 2
opts.inter_op_num_threads = 1
opts.log_severity_level = 3
sessions = {a.split("=")[0]: ort.InferenceSession(a.split("=", 1)[1], opts, providers=["CPUExecutionProvider"])
            for a in sys.argv[1:]}
x = np.random.default_rng(0).random((1, 3, 640, 640), dtype=np.float32)
times = {k: [] for k in sessions}
for s in sessions.values():
    for _ in range(2):
        s.run(None, {"images": x})
for _ in range(7):
    for k, s in sessions.items():
        t = time.perf_counter()
        s.run(None, {"images": x})
        times[k].append(time.perf_counter() - t)
first = next(iter(times))
for k, v in times.items():
    print(f"| {k} | {1000 * np.median(v):.1f} ({1000 * np.percentile(v, 10):.1f}-{1000 * np.percentile(v, 90):.1f}) | "
          f"{np.median(times[first]) / np.median(v):.2f}x |")
