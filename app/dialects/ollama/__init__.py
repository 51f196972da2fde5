"""Ollama's API under /api: routes, its request bodies and their translation (protocol.py)."""
