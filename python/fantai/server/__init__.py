"""Server room: OpenAI- and Anthropic-compatible HTTP API over the async engine (`fantai serve`)."""
