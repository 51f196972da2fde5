"""Generation, dialect-free: the one gate (admission.py), the one way in (admit.py: render, tokenize, plan, submit),
the prompt of a chat (chat_request.py, with tool_prompts.py: tools and tool history in the prompt, and
tool_grammar.py: the grammar that forces a call), the request queued (submit.py), the one loop over a request's
outputs (stream.py: the timeout, the streamed response), the outputs read back (chat_output.py; parsers/:
reasoning, tool calls, declared formats), embeddings (embeddings.py). A dialect (app/dialects/) translates its
request into this and the outputs into its wire format."""
