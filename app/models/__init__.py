"""The models a server runs: ModelHost (host.py: its own model, swaps, models on demand), the one way an engine is
built (factory.py), what the models directory holds (catalog.py), downloads (pull.py), the admin routes."""
