"""Durability: experience batches in HDF5, model checkpoints, and the run manifest that ties them together."""
