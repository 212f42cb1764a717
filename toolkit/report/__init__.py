"""`slurm-rlhf report RUN_DIR`: one self-contained HTML page (and its PNGs) about a run: curves, step time
by phase, a timeline of every worker's phases, sample responses, the config and the placement."""
