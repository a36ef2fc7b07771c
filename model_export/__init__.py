"""ELMo at build time: options, the PyTorch biLM, the published weight layout, ONNX export."""
