"""Chapter 08 — the HTTP layer: an OpenAI-compatible API in front of the AsyncLLMEngine."""
