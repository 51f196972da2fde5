"""The APIs local tools speak, one package each: a thin adapter from its request to the canonical one (app/generate/)
and from the engine's outputs to its wire format. OpenAI's (chat, completions, responses, embeddings, tokenize) is
the canonical one."""
