"""run.fast_mkl_on_amd: on an AMD CPU each worker preloads a one-function library that makes MKL take its
Intel kernels; the library is built once, privately, never half-written, and changes no result beyond
float rounding."""

import ctypes
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.launch import allocator, mkl_amd, preload

REPO = Path(__file__).resolve().parents[2]
# A few matrix products and one training step of a small Llama-shaped MLP, with fixed seeds: their numbers.
NUMBERS = """
from toolkit.launch.preload import reexec_with_preloads
reexec_with_preloads()  # (what a worker does first)
import ctypes, json, os, torch
torch.manual_seed(0)
x, w = torch.randn(300, 256), torch.randn(512, 256)
net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
losses = []
for _ in range(3):
    loss = (net(x) - x).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    losses.append(loss.item())
intel = getattr(ctypes.CDLL(None), "mkl_serv_intel_cpu_true", None)
print(json.dumps({"pid": os.getpid(), "product": torch.nn.functional.linear(x, w).sum().item(), "losses": losses,
                  "preload": os.environ.get("LD_PRELOAD", ""), "intel": intel() if intel else None}))
"""


def run(program: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LD_PRELOAD", allocator.ENV, mkl_amd.ENV, preload.CHECKED)}
    proc = subprocess.Popen([sys.executable, "-c", program], cwd=REPO, env={**clean, **env}, stdout=subprocess.PIPE,
                            text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    got = json.loads(out.splitlines()[-1])
    assert got.get("pid", proc.pid) == proc.pid  # (an exec: the same process)
    return got


def test_the_library_is_built_privately_in_one_piece_and_answers_yes(tmp_path):
    folder = tmp_path / "built"
    path = mkl_amd._build(str(folder))
    assert path == str(folder / mkl_amd.NAME)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == [mkl_amd.NAME]  # (no temporary file left)
    assert ctypes.CDLL(path).mkl_serv_intel_cpu_true() == 1
    # a folder or a library that someone else may write is never used
    assert mkl_amd._own(path) and mkl_amd._own(str(folder))
    os.chmod(path, 0o775)
    assert not mkl_amd._own(path)
    os.chmod(folder, 0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        mkl_amd._build(str(folder))


def test_a_node_without_a_compiler_is_told_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(FileNotFoundError, match=r"no C compiler \(cc or gcc\) on this node; install gcc"):
        mkl_amd._build(str(tmp_path / "built"))
    assert not (tmp_path / "built").exists()
    monkeypatch.setattr(mkl_amd, "amd", lambda: True)
    monkeypatch.setattr(mkl_amd, "folders", lambda: [str(tmp_path / "a"), str(tmp_path / "b")])
    path, why = mkl_amd.library()
    assert path is None and why.startswith(f"could not build it ({tmp_path / 'a'}: no C compiler")
    # the preload looks for it once; the worker's log line then says why without another try
    monkeypatch.setenv(mkl_amd.ENV, "1")
    monkeypatch.delenv(mkl_amd.WHY, raising=False)
    monkeypatch.setenv(allocator.ENV, "system")
    assert preload.wanted() == [] and os.environ[mkl_amd.WHY] == why
    monkeypatch.setattr(mkl_amd, "_build", lambda folder: pytest.fail("built again"))
    assert mkl_amd.describe() == f"MKL on AMD: as shipped, at about half its speed (run.fast_mkl_on_amd: {why})"
    monkeypatch.delenv(mkl_amd.WHY)  # (a process that did not go through the preload)
    assert mkl_amd.describe() == ("MKL on AMD: as shipped, at about half its speed (run.fast_mkl_on_amd: the "
                                  "library was not preloaded into this process)")


@pytest.mark.skipif(not mkl_amd.amd(), reason="MKL's library is preloaded on AMD CPUs only")
def test_a_worker_on_an_amd_cpu_runs_again_with_the_library_and_gets_the_same_numbers():
    with_it = run(NUMBERS, **{mkl_amd.ENV: "1", allocator.ENV: "auto"})
    path, _ = mkl_amd.library()
    assert with_it["preload"].split(" ")[1] == path and with_it["intel"] == 1  # (after the allocator's)
    as_shipped = run(NUMBERS, **{mkl_amd.ENV: "0", allocator.ENV: "auto"})
    assert mkl_amd.NAME not in as_shipped["preload"] and as_shipped["intel"] is None
    assert with_it["product"] == pytest.approx(as_shipped["product"], rel=1e-5, abs=1e-2)
    assert with_it["losses"] == pytest.approx(as_shipped["losses"], rel=1e-5)
    assert with_it["losses"][-1] < with_it["losses"][0]  # (it trained)
    line = "import json; from toolkit.launch import mkl_amd; print(json.dumps({'line': mkl_amd.describe()}))"
    assert run(line, **{mkl_amd.ENV: "0"})["line"] == "MKL on AMD: as shipped (run.fast_mkl_on_amd false)"
    assert run("from toolkit.launch.preload import reexec_with_preloads; reexec_with_preloads();" + line,
               **{mkl_amd.ENV: "1"})["line"] == "MKL on AMD: Intel's code paths (run.fast_mkl_on_amd)"


def test_generate_samples_with_the_workers_libraries_unless_told_not_to(tiny, tmp_path):
    """`generate` (as `chat` and `eval`) samples in its own process: it preloads what a run's worker does
    (tcmalloc; on an AMD CPU, MKL's library), says so on its first line, and the environment turns them
    off; greedy samples are the same either way (transformers, whose matrix products are MKL's)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 2 3"}\n{"prompt": "hello"}\n')
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LD_PRELOAD", allocator.ENV, mkl_amd.ENV, preload.CHECKED)}
    runs = {}
    for label, env in (("with", {}), ("without", {allocator.ENV: "system", mkl_amd.ENV: "0"})):
        result = subprocess.run([sys.executable, "-m", "toolkit", "generate", str(tiny / "model"), "--input",
                                 str(prompts), "--backend", "hf", "--temperature", "0", "--max-new-tokens", "6"],
                                cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        line = next(s for s in result.stderr.splitlines() if s.startswith("sampling from "))
        runs[label] = line, [json.loads(s) for s in result.stdout.splitlines()]
    with_line, without_line = runs["with"][0], runs["without"][0]
    assert "memory allocator: tcmalloc" in with_line and "memory allocator: system" in without_line
    if mkl_amd.amd():
        assert "MKL on AMD: Intel's code paths" in with_line and "MKL on AMD: as shipped" in without_line
    with_samples, without_samples = runs["with"][1], runs["without"][1]
    assert [s["response"] for s in with_samples] == [s["response"] for s in without_samples]
    assert [s["logprob"] for s in with_samples] == pytest.approx([s["logprob"] for s in without_samples], abs=1e-4)
