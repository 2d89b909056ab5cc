"""What the benchmarks share: conversations, the streaming multi-turn client, `/metrics` figures,
bootstrap statistics."""
