"""Training a biLM (PyTorch): the corpus, the language model, elmo-train; its output is the published layout that
model_export reads and exports."""
