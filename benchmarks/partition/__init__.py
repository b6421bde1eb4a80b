"""The partition benchmark: split quality on a model zoo, planning speed on large graphs."""
