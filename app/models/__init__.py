"""The models a server runs: ModelHost (host.py: its own model, swaps, models on demand; residents.py: what it keeps of
each), what to load (spec.py: ModelSpec and its checks), how long an idle model stays (keep_alive.py: Ollama's
durations), the one way an engine is built (factory.py), what the models directory holds (catalog.py), downloads
(pull.py), /v1/models and the admin routes (routes.py)."""
