"""Tests of the scripts of examples/: what a user runs (`tests/scripts.py` runs them)."""
