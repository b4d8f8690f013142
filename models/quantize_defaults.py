"""Calibration methods and defaults, importable without modelopt.

qat.py's argument parser needs them; importing modelopt starts CUDA (it asks ``torch.cuda.is_available()``),
and in a multi-GPU run CUDA must not start before ``--device`` has narrowed CUDA_VISIBLE_DEVICES
(``utils/qat/device.py``).
"""
CALIB_METHODS = ("max", "percentile", "mse", "entropy")
DEFAULT_CALIB_METHOD = "mse"
DEFAULT_PERCENTILE = 99.99
