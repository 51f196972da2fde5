"""OpenAI's API (and vLLM's tokenizer routes): chat completions and completions (routes.py), the Responses API,
embeddings, tokenize; protocol.py holds the request bodies every dialect translates into."""
