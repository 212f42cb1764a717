"""Roles of the RL loop: generator (samples), reference (log-probs), reward (scores), trainer (updates);
and the trainer ranks of a supervised stage (`sft`, `rm`), whose loop is in training/supervised.py."""


def make_role(worker, role: str):
    """The role object `role` hosted by `worker` (a worker may host several)."""
    if role == "generator":
        from toolkit.roles.generator import GeneratorRole
        return GeneratorRole(worker)
    if role == "reference":
        from toolkit.roles.scorer import ReferenceRole
        return ReferenceRole(worker)
    if role == "reward":
        from toolkit.roles.scorer import RewardRole
        return RewardRole(worker)
    if role in ("sft", "rm"):
        from toolkit.training.supervised import SupervisedRole
        return SupervisedRole(worker)
    from toolkit.roles.trainer import TrainerRole
    return TrainerRole(worker)
