"""yolov9-qat: quantization-aware training and INT8 deployment for YOLOv9 (overlay package)."""
__version__ = "0.1.0"
