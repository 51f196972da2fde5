"""Conversations kept server-side: the sessions API (routes.py, history_routes.py), one turn of a stored conversation
(service.py), the store's tables (conversations.py, system_prompts.py), export / import (history.py, markdown.py),
search, the sidebar's date groups."""
