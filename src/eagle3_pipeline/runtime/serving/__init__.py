"""Serving engines running this pipeline's export: vLLM's offline engine for the engine check."""
