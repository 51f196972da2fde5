"""The application layer: CLI now, the REST server later."""
