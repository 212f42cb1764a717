"""The command line: --help is instant and `import toolkit` pulls in no heavy library."""

from __future__ import annotations

import subprocess
import sys
import time

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
