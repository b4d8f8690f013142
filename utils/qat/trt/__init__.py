"""The TensorRT side: what both builders share, the Python-API builder and runner, trtexec, engine graphs, engine comparison and benchmark reports."""
