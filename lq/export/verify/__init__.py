"""Stage 5, verify: onnxruntime against the PyTorch fake-quant model, judged in output steps."""
