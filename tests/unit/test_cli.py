"""The command line: --help is instant and `import toolkit` pulls in no heavy library."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import cli


def test_help_is_fast_and_light():
    started = time.monotonic()
    result = cli("--help", timeout=30)
    assert result.returncode == 0 and "run" in result.stdout and "validate" in result.stdout
    assert time.monotonic() - started < 5
    probe = ("import sys, toolkit, toolkit.cli, toolkit.config, toolkit.launch.driver, toolkit.transport.wire; "
             "print(sorted(m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_unknown_command_exits_2():
    result = cli("frobnicate", timeout=30)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_cancel_never_signals_a_process_that_reused_the_drivers_pid(tmp_path):
    import psutil

    from toolkit.errors import RunError
    from toolkit.launch.env import node_name
    from toolkit.launch.jobs import cancel
    from toolkit.launch.rundir import RunDir

    other = subprocess.Popen(["sleep", "60"])  # a process that got the pid after the driver ended
    try:
        rd = RunDir(tmp_path / "run")
        rd.path.mkdir()
        born = psutil.Process(other.pid).create_time()
        rd.write_status({"state": "finished", "driver": {"pid": other.pid, "node": node_name(), "started": born - 600}})
        message = cancel(rd, timeout_s=5)
        assert "had already ended" in message and "left alone" in message
        assert other.poll() is None  # not signalled
        rd.write_status({"state": "running", "driver": {"pid": other.pid, "node": "n9", "started": born}})
        with pytest.raises(RunError, match="runs on node n9"):
            cancel(rd, timeout_s=5)
        assert other.poll() is None
        rd.write_status({"state": "running", "driver": {"pid": other.pid, "node": node_name(), "started": born}})
        assert "stopped the local driver" in cancel(rd, timeout_s=10)  # the recorded process itself: signalled
        assert other.wait(timeout=10) == -15
    finally:
        other.kill()
        other.wait()
