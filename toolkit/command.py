"""How a command ends, the CLI's and each tool's under `tools/`: one line and an exit code, no traceback."""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

from toolkit.errors import ToolkitError, raise_interrupt


def run_command(command: Callable[[], int | None]) -> int:
    """Runs `command` and gives the exit code for `sys.exit`: what it returned (0 for None); for a
    ToolkitError its `exit_code` after `error: ...`; 128 + the signal's number after `interrupted (SIGINT)` or
    `interrupted (SIGTERM)`, as a shell reports a process the signal ended.

    SIGINT and SIGTERM (scancel, a Slurm time limit, `kill`) end the command through its clean-up: what it
    was writing removed, child processes and vLLM shut down with their temporary files; also where SIGINT
    was inherited as ignored (the background of a script). A run's driver puts its own handlers in place while
    its workers run."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt_once)
    try:
        code = command()
        sys.stdout.flush()  # (here, not at exit: a reader that left is met below)
        return code or 0
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
        print(f"interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # (the reader of its output left, as `| head` does: end quietly, as Unix tools do)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error when Python flushes)
        return 128 + signal.SIGPIPE
    finally:
        # The command is over: a second Ctrl-C (or a SIGTERM) from here on would come while Python exits,
        # after it has put back the default handlers, and kill the process by the signal instead of
        # letting it end with what it returned (130 after "interrupted"); ignored, it changes nothing.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _interrupt_once(signum, frame):
    """The first SIGINT or SIGTERM ends the command through its clean-up; the ones after it are ignored, so that
    they cannot cut that clean-up short (Ctrl-C pressed twice, or given to `timeout N slurm-rlhf ...`, which
    passes it on a second time: it raised in vLLM's shutdown, a traceback and its file left in TMPDIR)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise_interrupt(signum, frame)
