"""Stage 2, trace: the model through torch.onnx, lq quantizers as placeholder ops."""
