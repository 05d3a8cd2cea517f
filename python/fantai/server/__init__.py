"""HTTP serving room: OpenAI- and Anthropic-compatible API over the async engine (`fantai serve`)."""
