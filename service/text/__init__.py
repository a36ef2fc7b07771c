"""Text as the biLM reads it: Moses tokens (moses), the published char mapping (chars), and each model family's
token ids (token_ids)."""
