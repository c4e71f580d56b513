"""HTTP frontend: OpenAI-compatible API, batching, tokenization, engine client."""
