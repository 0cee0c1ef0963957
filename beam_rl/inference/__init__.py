"""Inference: the client of real or embedded vLLM servers (client.py), and the embedded vLLM-compatible
server (server.py) with its backends (stepped.py: model and instant; simulated.py)."""
