"""The ONNX side: graph helpers, Q/DQ rewriting and lint, End2End NMS, and the one exporter."""
