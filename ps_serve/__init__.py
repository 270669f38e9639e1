"""ps-serve: an ONNX model behind the Open Inference Protocol (KServe v2)."""
