"""The client of vLLM servers, real or stand-in: `client.py` (requests, streaming, their transport),
`weight_updates.py` (the three update modes), `inflight.py` (what is in flight at a pause), `parsing.py`
(what answers say), `types.py` (what it takes and returns), `errors.py`, `sse.py`."""
