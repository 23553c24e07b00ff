"""FastAPI lookup and inference server."""
