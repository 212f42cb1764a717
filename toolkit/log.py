"""Logging set up once per process, records prefixed with `[role:rank]`."""

import logging
import sys


def setup_logging(tag: str, level: int = logging.INFO, stream=None, file: str | None = None) -> None:
    """Send records to `stream` (default stderr) and optionally `file`, each line prefixed `[tag]`."""
    fmt = logging.Formatter(f"%(asctime)s [{tag}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.DEBUG if file else level)
    console = logging.StreamHandler(stream or sys.stderr)
    console.setLevel(level)
    console.setFormatter(fmt)
    root.addHandler(console)
    if file:
        handler = logging.FileHandler(file)
        handler.setLevel(logging.DEBUG)
        handler.setFormatter(fmt)
        root.addHandler(handler)
    # Chatty libraries: keep their warnings, drop their debug noise.
    for name in ("urllib3", "filelock", "h5py", "asyncio"):
        logging.getLogger(name).setLevel(logging.WARNING)
