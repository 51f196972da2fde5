"""The application layer, laid out as a request's path: http/ (what every request passes: access, limits,
disconnects, errors, metrics) -> dialects/<api>/ (each API's routes and request bodies: OpenAI's, the canonical one,
Ollama's, Anthropic's) -> generate/ (dialect-free: the one admission gate, the one way in, the outputs read back) ->
the engine (kvforge.core). Beside it: models/ (the model host, the engine factory, the catalog, pulls, the admin
routes), sessions/ (conversations kept server-side), context.py (what every route shares), server.py (the app
assembled), settings.py (every `kvforge serve` setting, declared once), cli/, bench/, quantize/."""
