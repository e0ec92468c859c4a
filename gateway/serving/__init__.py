"""Serving: uvicorn with a drain, client connection hygiene, the `serve --workers` supervisor."""
