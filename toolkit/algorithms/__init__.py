"""Algorithms as pure tensor functions: advantages (GRPO, GAE), losses (PPO policy/value, KL), KL control."""
