"""An example beam-rl environment package (see letter_words.py and this package's pyproject.toml)."""
