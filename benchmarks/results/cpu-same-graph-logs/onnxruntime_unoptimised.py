"""val_trt.py with ONNX Runtime's graph optimisations off: the same graph computed in another order of float
operations, to see how far ONNX Runtime's score moves against itself (cpu-same-graph.md). A diagnostic that
replaces onnxruntime.SessionOptions for one run; run from the top of a patched YOLOv9 tree with val_trt.py's flags:

    python3 /path/to/onnxruntime_unoptimised.py --onnx W.onnx --backend onnxruntime --data coco.yaml --num-image 100
"""
import runpy
import sys

import onnxruntime as ort

_Options = ort.SessionOptions


class _Unoptimised(_Options):
    def __init__(self):
        super().__init__()
        self.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL


ort.SessionOptions = _Unoptimised
sys.path.insert(0, ".")
sys.argv = ["val_trt.py", *sys.argv[1:]]
runpy.run_path("val_trt.py", run_name="__main__")
