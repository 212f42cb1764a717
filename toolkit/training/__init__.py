"""What every training stage shares (SFT, reward model, the RL trainer): the data-parallel ranks, the
DeepSpeed engine, checkpoints with exact resume, Hugging Face export, and the EMA of the weights."""
