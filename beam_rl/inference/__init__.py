"""The client of vLLM servers, real or stand-in: `client.py` (requests, streaming, weight updates),
`inflight.py` (what is in flight at a pause), `types.py` (what it takes and returns), `sse.py`."""
