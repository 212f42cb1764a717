"""Weight sync between processes: after a sync the generator computes what the trainer computes.

The generator's full log-softmax at every position is compared with the trainer's: equal log-prob
vectors mean equal logits up to a constant per position (which no sampling can tell apart).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tests.conftest import REPO, example, write_config
from toolkit.transport.rendezvous import serve_store
from toolkit.weights.sync import WeightSender, form_group, gathered_buckets, manifest_of

pytestmark = pytest.mark.integration


def peer(*args, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.integration.peers", *map(str, args)], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log_path, timeout=240) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert code == 0, f"peer failed ({code}):\n{log_path.read_text()[-4000:]}"


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_generator_logprobs_equal_trainer_after_sync(backend, tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={"backend": backend}))
    g = torch.Generator().manual_seed(0)
    sequences = [[1, *torch.randint(3, 500, (40,), generator=g).tolist()] for _ in range(3)]
    (tmp_path / "seqs.json").write_text(json.dumps(sequences))
    store = serve_store("127.0.0.1", 120)
    log_path = tmp_path / "peer.log"
    with open(log_path, "w") as log:
        proc = peer("generator", config, backend, "127.0.0.1", store.port, tmp_path / "out.json",
                    tmp_path / "seqs.json", log=log)
    try:
        # The trainer's weights: the checkpoint moved by seeded noise, so a missed sync cannot pass.
        model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        params = list(model.named_parameters())
        sender = WeightSender(form_group(store, 0, 2, 120, torch.device("cpu")), manifest_of(params), 64 * 1024,
                              torch.device("cpu"))
        assert len(sender.buckets) > 5
        sent = sender.send(1, gathered_buckets([p for _, p in params], sender.buckets, zero3=False))
        assert sent == sum(p.numel() * 4 for _, p in params)
    finally:
        finish(proc, log_path)
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["version"] == 1
    with torch.no_grad():
        expected = [model(torch.tensor([s])).logits[0, :-1].log_softmax(-1) for s in sequences]

    def max_diff(runs):
        return max(abs(lp - float(expected[i][pos, int(token)]))
                   for i, run in enumerate(runs) for pos, step in enumerate(run) for token, lp in step.items())

    vocab = expected[0].shape[-1]
    assert all(len(step) == vocab for run in result["after"] for step in run)  # the whole vocabulary
    assert max_diff(result["before"]) > 1e-2  # before the sync the generator has other weights
    print(f"{backend}: max |generator - trainer| log-prob after sync {max_diff(result['after']):.2e}, before {max_diff(result['before']):.2e}")
    assert max_diff(result["after"]) <= 1e-5, max_diff(result["after"])


def test_zero3_trainer_sends_full_gathered_weights(tiny, tmp_path):
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={"backend": "hf"}))
    logs = [tmp_path / f"{name}.log" for name in ("rank0", "rank1", "receiver")]
    files = [open(p, "w") for p in logs]
    procs = [peer("zero3", 0, config, tmp_path, log=files[0]), peer("zero3", 1, config, tmp_path, log=files[1]),
             peer("receiver", config, tmp_path, log=files[2])]
    try:
        for proc, path in zip(procs, logs):
            finish(proc, path)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for f in files:
            f.close()
    assert (tmp_path / "partitioned").read_text() == "True"  # each rank really held only a shard
    expected = torch.load(tmp_path / "expected.pt")
    received = torch.load(tmp_path / "received.pt")
    assert received["version"] == 1 and set(received["weights"]) == set(expected)
    from transformers import AutoModelForCausalLM

    initial = dict(AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32).named_parameters())
    for name, tensor in expected.items():
        assert tensor.shape == initial[name].shape
        assert torch.equal(received["weights"][name], tensor), name
    assert any(not torch.equal(expected[n], initial[n].data) for n in expected)  # the step changed the weights
