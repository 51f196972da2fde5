"""The application layer, laid out as a request's path: http/ (what every request passes: access, limits, disconnects,
errors, metrics) -> dialects/<api>/ (each API's routes and request bodies: OpenAI's, Ollama's, Anthropic's; each maps
its request to the canonical one and the reply's parts to its wire format) -> generate/ (dialect-free: the canonical
request, the one admission gate, the one way in, the outputs read back into the reply's parts) -> the engine
(kvforge.core). Beside it: models/ (the model host, the engine factory, the catalog, pulls, the admin routes), sessions/
(conversations kept server-side), context.py (what every route shares), server.py (the app assembled), settings.py
(every `kvforge serve` setting, declared once), cli/, bench/, quantize/."""
