"""The HTTP routes, one module an API: ``anthropic`` (Messages, count_tokens), ``openai``
(Chat Completions), ``agents`` (the agents REST API); ``anthropic_content`` reads Anthropic
content blocks and tools."""
