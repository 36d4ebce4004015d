"""The OpenAI-compatible HTTP API (FastAPI) over an `EngineFront`: routes, request
validation, OpenAI error bodies, response and SSE building, Prometheus metrics."""
