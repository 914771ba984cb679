"""Tests of the scripts of benchmarks/: subprocess smoke runs, and unit tests of a
script's logic (`tests/scripts.py` runs and loads them)."""
