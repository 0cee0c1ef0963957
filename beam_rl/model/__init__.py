"""The policy model's files: where they are (`location`), its tokenizer (`tokenizer`), and the tiny model
built offline for tests and the embedded default (`tiny`)."""
