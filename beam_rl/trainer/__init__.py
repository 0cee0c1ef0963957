"""The trainer's side of the run directory: `reader.py` reads committed steps as a trainer sees them,
and the reference trainer (`reference.py`, `policy_loss.py`, `checkpoint.py`) trains on them and
publishes weights. Nothing here is imported by the orchestrator's stages; importing the reader does not
import torch."""
