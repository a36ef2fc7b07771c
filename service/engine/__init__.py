"""ONNX Runtime: the session on an exported graph and its state store (session), the typed interfaces it is called
through (backend), what a call is fed (feeds), rows packed with sentences (packing), the token-vector cache
(token_cache), providers and placement (providers), and the start-up canary (canary)."""
