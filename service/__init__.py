"""ELMo embeddings at run time: char mapping, ONNX Runtime engine, bulk embedding (no torch)."""

# The one place the version is written: pyproject.toml reads it (`dynamic = ["version"]`), and elmo-serve
# --version, /info and the OpenAPI document report it.
__version__ = "0.1.0"
