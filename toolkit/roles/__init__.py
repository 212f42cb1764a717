"""Roles of the RL loop: generator (samples), scorer (reference log-probs, rewards), trainer (updates)."""


def make_role(worker):
    """The role object for `worker`'s group (one role per worker in the separation placement)."""
    (role,) = worker.group.roles
    if role == "generator":
        from toolkit.roles.generator import GeneratorRole
        return GeneratorRole(worker)
    if role == "scorer":
        from toolkit.roles.scorer import ScorerRole
        return ScorerRole(worker)
    from toolkit.roles.trainer import TrainerRole
    return TrainerRole(worker)
