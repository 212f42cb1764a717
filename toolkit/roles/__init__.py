"""Roles of the RL loop: generator (samples), reference (log-probs), reward (scores), trainer (updates)."""


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
    from toolkit.roles.trainer import TrainerRole
    return TrainerRole(worker)
