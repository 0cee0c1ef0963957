"""What the training signal gets: environments mixed by target share, and the curriculum on the tiny run."""
