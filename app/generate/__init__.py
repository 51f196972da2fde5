"""Generation, dialect-free: the one gate (admission.py), the one way in (admit.py: render, tokenize, plan, submit),
the engine outputs read back (completion.py, chat_output.py; parsers/: reasoning, tool calls, declared formats),
embeddings (embeddings.py). A dialect (app/dialects/) translates its request into this and the outputs into its wire
format."""
