"""Placement: which roles share a worker, and how many workers of each kind (node groups)."""
