"""The tools under tools/ that measure a part by calling the toolkit's own functions (a role's `handle`,
the engine builder, the experience record, the weight sender), not through the CLI, run end to end on a
small workload, and what they print holds. Nothing else runs them: changes inside the toolkit broke two
of them unnoticed (calibrate.py called a function that had gone, bench_generate.py built a worker that
lacked what the generator now reads). Their speed figures are not checked here; the README's tables come
from their full runs."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, running
from toolkit.placement.cluster import load_cluster

pytestmark = pytest.mark.integration


def tool(*args: str) -> subprocess.CompletedProcess:
    """The tool's run, which ended with 0: its tables on stdout, what it said on stderr."""
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def ratio_of(out: str) -> float:
    """The figure of the tool's last line, `ratio R  (...)`."""
    found = re.search(r"^ratio (\d+\.\d+)", out.strip().splitlines()[-1])
    assert found, out[-2000:]
    return float(found.group(1))


def rows_of(out: str, first_words: tuple[str, ...]) -> dict[str, list[str]]:
    """The table rows that start with each of `first_words`: the cells after the label, split on spaces."""
    rows = {}
    for line in out.splitlines():
        for label in first_words:
            if line.startswith(label + " ") and label not in rows:
                rows[label] = line[len(label):].split()
    assert set(rows) == set(first_words), out[-2000:]
    return rows


def test_calibrate_writes_a_cluster_file_the_planner_reads(tmp_path):
    out = tmp_path / "cluster.yaml"
    done = tool("tools/calibrate.py", "--out", str(out))
    assert "vLLM is not installed" not in done.stderr  # (its decode figures measured by vLLM itself)
    cluster = load_cluster(out)
    assert cluster.nodes == 1 and cluster.shared
    assert cluster.device.flops > 1e9 and cluster.device.memory_bandwidth > 1e8
    assert cluster.links.intra_node > 1e6 and 0 < cluster.links.latency_s < 0.1
    o = cluster.overheads
    # (a per-call cost is the time beyond the FLOP and byte terms, 0 where a busy machine hid it)
    assert 0 < o.decode_step_vllm + o.decode_per_sequence_vllm < 1
    assert 0 < o.decode_step_hf + o.decode_per_sequence_hf < 1
    assert 0 < o.message < 1 and 0 < o.step < 1
    # the share of the cores vLLM's generation left to probes beside it, as printed
    assert 0 <= cluster.device.generation_idle < 1
    assert f"generation leaves {cluster.device.generation_idle:.0%} of" in done.stderr
    assert "calibrate.py --config templates/examples/tiny-grpo.yaml" in cluster.measured


def test_bench_generate_generates_the_same_tokens_each_way():
    out = tool("tools/bench_generate.py", "--repeats=1", "--new-tokens=8").stdout
    rows = rows_of(out, ("bare vLLM (n=4 per prompt)", "bare vLLM, per-sample seed + log-probs",
                         "slurm-rlhf generator"))
    assert {cells[0] for cells in rows.values()} == {str(16 * 4 * 8)}  # every response full length
    assert ratio_of(out) > 0


@pytest.mark.parametrize("name, args, same", [
    ("bench_rl_batches", ["--samples=8", "--rows=2", "--max-response=32", "--repeats=1"], "weights diff"),
    ("bench_scoring", ["--samples=16", "--batch=4", "--max-response=64", "--repeats=1"], "max log-prob diff"),
])
def test_packed_and_padded_batches_compute_the_same(name, args, same):
    """Training updates (bench_rl_batches) and log-prob passes (bench_scoring) packed against padded: the
    tool prints the largest difference, in the last column of the packed row."""
    out = tool(f"tools/{name}.py", *args).stdout
    assert same in out
    packed = next(line for line in out.splitlines() if "packed" in line and not line.startswith("ratio"))
    assert " 0% " in packed  # (no padding)
    assert float(packed.split()[-1]) < 1e-4
    assert ratio_of(out) > 0


def test_bench_sync_store_and_transport_run_their_tables(tmp_path):
    """The weight sender against a raw broadcast, the experience commit against a plain write, and the
    rollout stream against raw pyzmq: each row's ratio is a number, and the last line's is the lowest of
    those it is taken over (the rows named here)."""
    # (tool, arguments, the rows the last line's ratio is the lowest of, that ratio's cell in a row)
    for name, args, columns, cell in (
            ("bench_sync", ["--repeats=1"], ("Llama (bench_trl) 26M", "Llama, 32k vocab 134M"), 7),  # (with the check)
            ("bench_store", ["--repeats=1", "--steps=0", f"--dir={tmp_path}"],
             ("512 x 512 tokens", "1024 x 2048 tokens"), -1),  # (batches of 1 MB or more)
            ("bench_transport", ["--repeats=1", "--steps=0"],
             ("bench_trl step batch", "512 x 512 tokens", "1024 x 2048 tokens"), -1)):
        out = tool(f"tools/{name}.py", *args).stdout
        ratios = [float(cells[cell]) for cells in rows_of(out, columns).values()]
        assert all(r > 0 for r in ratios) and ratio_of(out) == min(ratios), (name, ratios, out[-2000:])


def test_bench_mkl_compares_mkl_as_shipped_with_its_intel_kernels():
    from toolkit.launch import mkl_amd

    out = tool("tools/bench_mkl.py", "--repeats", "1", "--micro-batches", "1").stdout  # (a quick check)
    if not mkl_amd.amd():
        assert out.strip() == "bench_mkl: nothing to compare here: not an AMD CPU"
        return
    diff = re.search(r"largest loss difference (\S+)$", out, re.M)
    assert diff and float(diff.group(1)) < 1e-5, out  # (the same losses within float rounding)
    rows = rows_of(out, ("F.linear MLP up/gate", "training step of the 26M Llama", "scoring forward pass"))
    assert all(float(cells[-1]) > 0 for cells in rows.values())
    assert ratio_of(out) > 0


def test_bench_openmp_busy_processes_end_with_it():
    """The CPU hogs that bench_openmp starts beside a run end when the tool is killed (SIGKILL: a test's or a
    job's time limit), which cannot kill them itself: they spun on, a core each."""
    import os
    import signal
    import time

    code = ("import sys, time; sys.path.insert(0, 'tools'); import bench_openmp; "
            "print(*[p.pid for p in bench_openmp.busy_processes(2)], flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    hogs = [int(pid) for pid in parent.stdout.readline().split()]

    try:
        assert len(hogs) == 2 and all(running(pid) for pid in hogs)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in hogs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(running(pid) for pid in hogs), hogs
    finally:
        parent.kill()
        for pid in hogs:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("lora", [False, True])
def test_bench_memory_counts_the_model_flops_that_torch_counts(lora):
    """The model FLOPs of bench_memory's MFU column are those of a forward and backward pass as torch's
    FlopCounterMode counts them (eager attention, whose matrix products it sees), LoRA's too: its attention
    scores were counted at 8 where their backward pass is the baseline's, 12."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "tools"))
    from bench_memory import flops_per_token
    from toolkit.config.base import EngineSection
    from toolkit.training.lora import add_adapters

    seq, batch = 256, 2
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, intermediate_size=688, max_position_embeddings=seq,
                                         tie_word_embeddings=False, attn_implementation="eager"))
    if lora:
        model = add_adapters(model, EngineSection(lora={"rank": 8}).lora)
    ids = torch.randint(0, 512, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    # (with LoRA, torch also counts the adapters' own small products, which MFU leaves out: within 2%)
    assert flops_per_token(model, seq, lora) == pytest.approx(counter.get_total_flops() / (batch * seq), rel=0.02)


def test_a_benchmark_killed_ends_its_runs_and_removes_its_files(tmp_path):
    """`kill` (SIGTERM) of a benchmark while its first run is going ends that run and removes the tool's
    temporary directory: the SFT run went on alone, and the directory stayed, after the tool had gone."""
    import os
    import signal
    import time

    tool_tmp = tmp_path / "tmp"
    tool_tmp.mkdir()
    bench = subprocess.Popen([sys.executable, "tools/bench_packing.py", "--steps=3", "--rows=64"], cwd=REPO,
                             env={**os.environ, "TMPDIR": str(tool_tmp)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)

    def children() -> list[int]:
        try:
            return [int(p) for p in open(f"/proc/{bench.pid}/task/{bench.pid}/children").read().split()]
        except FileNotFoundError:
            return []

    runs = []
    try:
        deadline = time.monotonic() + 600  # (it builds a model first: minutes on a busy machine)
        while not children() and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        runs = children()
        assert runs and any(tool_tmp.iterdir()), bench.communicate()
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == 143 and err.strip().endswith("interrupted (SIGTERM)"), (bench.returncode, err)
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in runs) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in runs if running(pid)]
        assert not left and not any(tool_tmp.iterdir()), (left, list(tool_tmp.iterdir()))
    finally:
        bench.kill()
        for pid in runs:
            if running(pid):
                os.kill(pid, signal.SIGTERM)  # (the CLI's clean-up ends its workers too)
