"""The OpenAI-compatible HTTP server (`loom serve`)."""
