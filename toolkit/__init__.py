"""slurm-rlhf: Slurm-native RLHF (PPO, GRPO) without Ray.

Importing this package is cheap: torch, vLLM and DeepSpeed are imported only by the roles that use them.
"""

__version__ = "0.1.0"
