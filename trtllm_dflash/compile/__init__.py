"""Compiled engines: ONNX graphs of the DFlash step (onnx_export.py), for onnxruntime and TensorRT."""
