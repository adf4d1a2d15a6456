"""What train.py, sample.py and the other commands import: the library around model.py, one concern a module."""
