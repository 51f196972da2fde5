"""What every request passes before and around its handler: the Host / Origin / key check (access.py, key_throttle.py,
login_sessions.py), bounded bodies and connections (limits.py), a client that leaves (disconnect.py), errors in each
dialect's shape (errors.py), the routes' fallbacks (fallbacks.py), Prometheus metrics (metrics.py)."""
