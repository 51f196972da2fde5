"""Anthropic's Messages API at /v1/messages: routes, its request bodies and their translation (protocol.py)."""
