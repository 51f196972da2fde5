"""The rerank API in the shape Jina, Cohere, vLLM and llama.cpp's server share: routes and request (routes.py)."""
