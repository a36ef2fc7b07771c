"""ELMo embeddings at run time: char mapping, ONNX Runtime engine, bulk embedding (no torch)."""
