"""What the peers need beside their own packages (issue 51): verifiers plug-ins (`vf_peer_prompts`, the harness's
prompts as a taskset; `vf_peer_direct`, a harness calling the model in-process), prime-rl's stubs and fake
trainer, and the peers' side venvs (`venvs.py`). The plug-in folders go on a peer's PYTHONPATH, not beam-rl's."""
