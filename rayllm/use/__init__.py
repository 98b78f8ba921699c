"""Using a trained model: pretrained.py (a checkpoint whole on one device: generate, export) and
evaluate.py (perplexity on Ray Data actors)."""
