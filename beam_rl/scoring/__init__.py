"""Scoring, the stage after a group completes (transforms/score.py): rewards (`rewards.py`, the LLM
judge in `judge.py`), advantages (`advantages.py`), filters (`filters.py`), samples (`samples.py`),
held-out evaluation (`evaluation.py`), and `group.py`'s `score_group`, which runs them on one group."""
