"""Generation, dialect-free: the canonical request (request.py: a chat or a raw prompt, and how each is rendered),
the one gate (admission.py), the one way in (admit.py: admission, render, tokenize, submit), the prompt of a chat
(chat_request.py, with tool_prompts.py: tools and tool history in the prompt, and tool_grammar.py: the grammar that
forces a call; context_fit.py: a chat longer than its context cut by its oldest whole turns), the one loop over a
request's outputs (stream.py: the timeout, the streamed response), the outputs read back into the reply's parts
(chat_output.py -> reply.py; parsers/: reasoning, tool calls, declared formats), embeddings (embeddings.py). A dialect
(app/dialects/) translates its request into this and the reply's parts into its wire format."""
