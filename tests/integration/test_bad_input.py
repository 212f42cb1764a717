"""Bad input, one table: each case names the field, file:line or function and the fix, exits non-zero,
and leaves no run directory (config errors, caught before anything starts) or no half-written file
(failures inside a run). A tokenizer without a pad token is not bad input: the run goes on."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import assert_no_workers_left, cli, example, write_config

pytestmark = pytest.mark.integration

REWARDS = """
def raises(prompt, response, **kw):
    raise ValueError("no reward today")

def not_a_number(prompt, response, **kw):
    return float("nan")

def text(prompt, response, **kw):
    return "high"
"""


def prompts_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    return str(path)


def no_pad_tokenizer(tiny: Path, tmp_path: Path) -> str:
    model = tmp_path / "model-without-pad"
    shutil.copytree(tiny / "model", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return str(model)


def slurm_conf_without_controller(tmp_path: Path) -> dict:
    """A copy of this cluster's slurm.conf whose controller port has nobody listening (and a message timeout
    of 1 s: each Slurm command gives up at once instead of after its 9 s of retries)."""
    text = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).read_text()
    path = tmp_path / "slurm.conf"
    path.write_text("\n".join("SlurmctldPort=1" if line.startswith("SlurmctldPort=") else line
                              for line in text.splitlines() if not line.startswith("MessageTimeout="))
                    + "\nMessageTimeout=1\n")
    return {"SLURM_CONF": str(path)}


HF = {"rollout": {"backend": "hf"}}  # (where the scorer fails: the transformers engine starts faster than vLLM)

# (case, command, how to change the config: {section: {key: value}} or a function of (tiny, tmp_path),
#  env (or a function of tmp_path), exit code, what the error says)
CASES = [
    ("a field of the wrong type", "run", {"rollout": {"prompts_per_step": "many"}}, None, 2,
     ["rollout.prompts_per_step", "many"]),
    ("a value out of range", "run", {"trainer": {"lr": -1}}, None, 2,
     ["trainer.lr: got -1: input should be greater than 0"]),
    ("an unknown field", "run", {"trainer": {"lrr": 1e-3}}, None, 2,
     ["trainer.lrr: unknown key 'lrr'; allowed here: zero_stage, lr"]),
    ("a missing model directory", "run", {"model": {"actor": "/no/such/model"}}, None, 2,
     ["model.actor: got '/no/such/model': no such directory", "give the path of a Hugging Face model directory"]),
    ("an empty prompt file", "run", lambda tiny, tmp: {"data": {"prompts": prompts_file(tmp, "")}}, None, 2,
     ["prompts.jsonl: no rows in the file"]),
    ("a malformed prompt file", "run",
     lambda tiny, tmp: {"data": {"prompts": prompts_file(tmp, '{"prompt": "a"}\n{"prompt": "b"\n')}}, None, 2,
     ["prompts.jsonl:2: not valid JSON"]),
    ("a reward function that cannot be imported", "run", {"reward": {"functions": [{"function": "nomodule:f"}]}},
     None, 2, ["reward.functions.0: cannot import module 'nomodule'", "add its folder to PYTHONPATH"]),
    ("a reward function that raises", "run", {"reward": {"functions": [{"function": "badrewards:raises"}]}, **HF},
     None, 1,
     # (the scorer's own report, not only its exit code: its last event got out before it exited)
     ["scorer worker rank 0 (scorer:0", ") failed: RewardFunctionError: reward function 'raises' (badrewards:raises) "
      "failed on prompt id", "ValueError: no reward today"]),
    ("a reward function that returns NaN", "run",
     {"reward": {"functions": [{"function": "badrewards:not_a_number"}]}, **HF}, None, 1,
     ["reward function 'not_a_number' (badrewards:not_a_number) returned nan for prompt id",
      "rewards must be finite numbers"]),
    ("a reward function that returns a non-number", "run",
     {"reward": {"functions": [{"function": "badrewards:text"}]}, **HF}, None, 1,
     ["reward function 'text' (badrewards:text) returned 'high' for prompt id", "rewards must be finite numbers"]),
    ("a tokenizer without a pad token (fine: the run goes on)", "run",
     lambda tiny, tmp: {"model": {"tokenizer": no_pad_tokenizer(tiny, tmp)}}, None, 0, []),
    pytest.param("an unreachable Slurm controller", "submit", {}, slurm_conf_without_controller, 1,
                 ["sbatch refused the job", "Unable to contact slurm controller",
                  "check that it runs (`sinfo`, `scontrol ping`)"], marks=pytest.mark.slurm),
]


@pytest.mark.parametrize("case,command,change,env,code,says", CASES)
def test_bad_input_gets_a_clear_error_and_leaves_nothing_half_written(tiny, tmp_path, case, command, change, env,
                                                                      code, says):
    (tmp_path / "badrewards.py").write_text(REWARDS)
    sections = change(tiny, tmp_path) if callable(change) else change
    data = example("tiny-grpo.yaml", tiny, run={"steps": 2, "name": "bad"})
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    config = write_config(tmp_path / "config", data)
    run_dir = tmp_path / "run"
    environ = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               **(env(tmp_path) if callable(env) else env or {})}
    result = cli(command, config, "--run-dir", run_dir, env=environ, timeout=600)
    assert result.returncode == code, f"{case}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    for text in says:
        assert text in result.stderr, f"{case}: {text!r} not in\n{result.stderr}"
    if code == 2 or command == "submit":  # refused before anything started: no run directory at all
        assert "Traceback" not in result.stderr
        for text in says:  # (and said once: sbatch's own words too, which Submitit would print again)
            assert result.stderr.count(text) == 1, f"{case}: {text!r} more than once in\n{result.stderr}"
        assert not run_dir.exists(), f"{case}: {run_dir} was left behind"
        if command == "submit":  # and a directory the user made for the run, empty, stays as it was
            given = tmp_path / "given"
            given.mkdir()
            again = cli(command, config, "--run-dir", given, env=environ, timeout=600)
            assert again.returncode == code and given.is_dir() and not list(given.iterdir()), again.stderr
    elif code == 1:  # failed inside the run: nothing half written, nothing committed for the failed step
        assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
        assert not list((run_dir / "experience").glob("step-*.h5")) if (run_dir / "experience").exists() else True
        assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
        assert_no_workers_left(run_dir)
    else:
        assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
