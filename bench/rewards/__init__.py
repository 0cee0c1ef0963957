"""What rewards cost the run: the code sandbox through the scoring stage, the trainer's wait on a slow judge, the
advantage error of failed rewards."""
