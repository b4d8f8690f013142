"""The quantization engine (nvidia-modelopt underneath), one concern per module:

    from utils.qat.quantize.config import QuantConfig        # settings as plain data (no modelopt, no torch)
    from utils.qat.quantize.model_quant import quantize      # fuse, place Q/DQ, calibrate
    qmodel, info = quantize(fp_model, batches, QuantConfig(method="mse"))

``config`` (settings and the record a checkpoint carries), ``model_quant`` (fuse, prepare, quantize),
``rules`` (where Q/DQ go, which scales are shared), ``calib`` (calibration; the only module reading
modelopt's calibrators), ``mse`` (the MSE clipping search), ``image_hist`` (per-image histograms),
``state`` (quantizers on/off/collecting, amax tables), ``qdq`` (the QuantizeLinear-exact fake
quantization; where a quantizer keeps its amax), ``head`` (``--head-amax search``), ``finetune`` /
``objectives`` / ``amax`` (QAT). Nothing is imported here, so
``config`` stays importable without modelopt.
"""
