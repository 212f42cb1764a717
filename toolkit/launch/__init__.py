"""Launching a run: the driver and coordinator, the worker entry point, and launchers (local, Slurm)."""
