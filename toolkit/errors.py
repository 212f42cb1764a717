"""Project errors: what the user did wrong (ConfigError) or how a run failed (RunError)."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's text, at most `limit` characters ('' for an error with no text)."""
    return (str(error).splitlines() or [""])[0][:limit]


class ToolkitError(Exception):
    """An error the CLI prints without a traceback."""

    exit_code = 1


class ConfigError(ToolkitError):
    """A run config (or a file it names) is wrong; raised before any process starts."""

    exit_code = 2


class RunError(ToolkitError):
    """A run stopped because a worker failed, stopped heart-beating or timed out."""

    exit_code = 1


class TrainerLost(RunError):
    """A worker that hosts trainer ranks died or hung without an error of its own: the run can go on from
    its last checkpoint (`run.max_trainer_restarts`)."""


class Interrupted(ToolkitError):
    """The user pressed Ctrl-C (or the driver got SIGTERM); the run was stopped cleanly. The exit code is
    128 + the signal's number, as a shell reports it: 130 for SIGINT, 143 for SIGTERM."""

    exit_code = 130

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


def raise_interrupt(signum, frame):
    """A signal handler: SIGINT or SIGTERM as KeyboardInterrupt(signum), so that the clean-up on the way
    out runs; the CLI then exits with 128 + signum, as a shell reports a process the signal ended."""
    raise KeyboardInterrupt(signum)
