"""ONNX Runtime: the session on an exported graph and its state store (session), what a call is fed (feeds), the
token-vector cache (token_cache), providers and placement (providers), and the start-up canary (canary)."""
