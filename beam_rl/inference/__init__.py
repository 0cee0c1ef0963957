"""Inference: the embedded vLLM-compatible server (server.py) and the client of real or embedded servers."""
