"""The stand-in: an in-repo HTTP server speaking vLLM's API (`server.py`), the embedded default and the
fault injector of the tests. Its backends: `stepped.py` (a tiny model or instant tokens, with vLLM's
admission and pause semantics), `simulated.py` (timing from a cost model, for fleet-scale runs). The
client (beam_rl/inference) never imports it."""
