"""vLLM on CPU starts without compiling: its small torch.compile helpers (the sampled token's rank among
the log-probs) run eagerly (vllm_engine.eager_helpers_on_cpu), which saves a C++ build of about 3.5 s
before every engine's first sample, and gives the same samples and log-probs as the compiled helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, example, write_config

pytestmark = pytest.mark.integration

# One engine's samples and log-probs, and how many frames torch.compile compiled meanwhile.
PROBE = """
import json, sys
import torch
from torch._dynamo.utils import counters
from toolkit.config import load_config
from toolkit.roles.engines.vllm_engine import VllmEngine

engine = VllmEngine(load_config(sys.argv[1]), torch.device("cpu"))
out = engine.generate([[5, 6, 7, 8], [9, 10]] * 4, list(range(8)))
top = engine.prompt_logprobs([5, 6, 7, 8, 9, 10], top=3)
print(json.dumps({"tokens": [c.tokens for c in out], "logprobs": [c.logprobs for c in out],
                  "top": [sorted(d.items()) for d in top], "frames": counters["frames"]["total"]}))
"""


def test_vllm_helpers_run_eagerly_on_cpu_with_the_same_numbers(tiny, tmp_path):
    """As the engine starts (eager), and with TORCH_COMPILE_DISABLE=0 (the user keeps compiling), side by
    side."""
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={"max_new_tokens": 8}))
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}
    procs = {name: subprocess.Popen([sys.executable, "-c", PROBE, str(config)], cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**env, **extra})
             for name, extra in (("eager", {}), ("compiled", {"TORCH_COMPILE_DISABLE": "0"}))}
    said = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
        said[name] = json.loads(out.strip().splitlines()[-1])
    eager, compiled = said["eager"], said["compiled"]
    assert eager["frames"] == 0 < compiled["frames"]
    assert eager["tokens"] == compiled["tokens"] and len(eager["tokens"]) == 8
    assert eager["logprobs"] == compiled["logprobs"] and eager["top"] == compiled["top"]
