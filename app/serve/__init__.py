"""`moechat serve`: the engine behind an OpenAI-compatible HTTP API. `server.py` (routes, auth, CORS and the
streaming responses), `request.py` (bodies parsed and checked, no HTTP), `worker.py` (the one thread that owns the
engine) and `metrics.py` (Prometheus text)."""
