"""Weight sync between processes: after a sync the generator computes what the trainer computes.

The generator's full log-softmax at every position is compared with the trainer's: equal log-prob
vectors mean equal logits up to a constant per position (which no sampling can tell apart).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from tests.conftest import REPO, example, write_config
from toolkit.launch.env import ATTEMPT, SECRET_FILE
from toolkit.tiny import build_family
from toolkit.transport.rendezvous import connect_store, serve_store
from toolkit.transport.wire import new_secret
from toolkit.weights.hf_format import checkpoint_converter, identity
from toolkit.weights.probe import model_logprobs, probe_tokens
from toolkit.weights.sync import WeightSender, _prefixed, arrived, form_group, gathered_buckets, plan_layout

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def run_key(tmp_path, monkeypatch):
    """The environment a run gives its workers, from which the rendezvous store takes its key (the peer
    processes inherit it)."""
    secret = tmp_path / "secret"
    secret.write_bytes(new_secret())
    secret.chmod(0o600)
    monkeypatch.setenv(SECRET_FILE, str(secret))
    monkeypatch.setenv(ATTEMPT, "test")


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


def sync_once(config, model_dir, backend: str, tmp_path, refresh: str = "refresh",
              check: bool = True) -> tuple[dict, list, torch.nn.Module]:
    """A generator peer (BACKEND) receives one version of the weights: the model at `model_dir` moved by
    seeded noise (so a missed sync cannot pass). Returns the peer's record, the sequences and the model.
    `check` False: as with rollout.sync_check false, the layout has no probe, which must never be computed."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    sequences = [[1, *torch.randint(3, 500, (40,), generator=g).tolist()] for _ in range(3)]
    (tmp_path / "seqs.json").write_text(json.dumps(sequences))
    store = serve_store("127.0.0.1", 120)
    log_path = tmp_path / "peer.log"
    with open(log_path, "w") as log:
        proc = peer("generator", config, backend, "127.0.0.1", store.port, tmp_path / "out.json",
                    tmp_path / "seqs.json", refresh, log=log)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        params = list(model.named_parameters())
        convert = checkpoint_converter(model) if backend == "vllm" else identity
        layout = plan_layout(params, 64 * 1024, probe_tokens(500, 0) if check else [], convert)
        sender = WeightSender(layout, torch.device("cpu"))
        sender.add("0", form_group(store, 0, 2, 120, torch.device("cpu")))
        assert len(layout.sources) > 5

        def probe():
            assert check, "the probe was computed although the check is off"
            return model_logprobs(model, layout.probe)

        sent = sender.send(1, gathered_buckets([p for _, p in params], layout.sources, zero3=False), probe)
        assert sent == sum(p.numel() * 4 for _, p in params)
    finally:
        finish(proc, log_path)
    return json.loads((tmp_path / "out.json").read_text()), sequences, model


def max_diff(runs, sequences, model) -> float:
    with torch.no_grad():
        expected = [model(torch.tensor([s])).logits[0, :-1].log_softmax(-1) for s in sequences]
    return max(abs(lp - float(expected[i][pos, int(token)]))
               for i, run in enumerate(runs) for pos, step in enumerate(run) for token, lp in step.items())


@pytest.mark.parametrize("backend,family", [("vllm", "llama"), ("hf", "llama"), ("vllm", "gpt2-tied"),
                                            ("vllm", "qwen2-moe")])
def test_generator_logprobs_equal_trainer_after_sync(backend, family, tiny, tmp_path):
    """The tiny Llama, a model with tied embeddings and a mixture of experts (whose experts transformers
    fuses in memory, so they travel converted to the checkpoint layout)."""
    model_dir = tiny / "model" if family == "llama" else build_family(REPO / "models" / f"tiny-{family}", family)
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={"backend": backend},
                                            model={"actor": str(model_dir)}))
    result, sequences, model = sync_once(config, model_dir, backend, tmp_path)
    assert result["version"] == 1
    vocab = model.config.vocab_size
    assert all(len(step) == vocab for run in result["after"] for step in run)  # the whole vocabulary
    before, after = max_diff(result["before"], sequences, model), max_diff(result["after"], sequences, model)
    assert before > 1e-2  # before the sync the generator has other weights
    print(f"{backend} {family}: max |generator - trainer| log-prob after sync {after:.2e}, before {before:.2e}; "
          f"probe check {result['check']}")
    assert after <= 1e-5, after
    assert isinstance(result["check"], float) and result["check"] <= 1e-5  # the probe agrees
    # nothing compiled: vLLM's torch.compile helpers (each log-prob's rank) ran eagerly on this CPU
    # (vllm_engine.eager_helpers_on_cpu), with the log-probs above still the trainer's
    assert result["compiled_frames"] == 0, result["compiled_frames"]


def test_without_the_check_no_probe_is_computed_or_sent(tiny, tmp_path):
    """rollout.sync_check false: the trainer's layout has no probe, so neither side runs its forward pass
    (on a CPU it reads every weight once, as much as the transfer) and the group stays in step."""
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={"backend": "hf", "sync_check": False}))
    result, sequences, model = sync_once(config, tiny / "model", "hf", tmp_path, check=False)
    assert result["version"] == 1 and result["check"] is None
    assert max_diff(result["after"], sequences, model) <= 1e-5


def test_sync_check_finds_a_stale_lm_head(tiny, tmp_path):
    """Without the repair of vLLM's derived weights, the tied LM head of GPT-2 stays stale after the sync
    (vLLM only logs a warning): the probe check must say so, by name."""
    model_dir = build_family(REPO / "models" / "tiny-gpt2-tied", "gpt2-tied")
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, model={"actor": str(model_dir)}))
    result, sequences, model = sync_once(config, model_dir, "vllm", tmp_path, refresh="none")
    assert max_diff(result["after"], sequences, model) > 1e-2  # the fault is real
    assert isinstance(result["check"], str), result["check"]
    assert "after the weight sync to policy_version 1, the peer computes other log-probs" in result["check"]
    assert "Some weights did not reach the generator" in result["check"]
    assert "Failed to load weights" in (tmp_path / "peer.log").read_text()  # all vLLM itself says


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


def test_a_peer_that_arrived_and_ended_fails_its_group_within_connect_s_not_the_timeout(tmp_path):
    """Rank 0 forms a weight-sync group only once its peers arrived (`arrived`), as the trainer does with
    a generator started again. A peer that ended after it arrived never connects: rank 0's group fails,
    named, within `connect_s`, not after the group's timeout (the trainer waited startup_timeout_s,
    600 s by default, before). A peer that connects and then takes longer than `connect_s` to send
    still gets the whole timeout: it is the connections alone that `connect_s` bounds."""
    store = serve_store("127.0.0.1", 120)
    client = connect_store("127.0.0.1", store.port, 120)  # (kept: torch's side of a store needs its Python one)
    gone = _prefixed(client, "generator:0#1")
    gone.set("gpu/1", "None")  # (what form_group's rank 1 writes on arriving; this one then ends)
    gone.set("arrived/1", "1")
    assert arrived(store, "generator:0#1", 2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"weight-sync group 'generator:0#1': its 1 peer rank\(s\) had arrived, "
                                           r"but did not connect within 3 s"):
        form_group(store, 0, 2, 600, torch.device("cpu"), "generator:0#1", connect_s=3)
    assert time.monotonic() - started < 60

    log_path = tmp_path / "late.log"
    with open(log_path, "w") as log:
        proc = peer("late", store.port, "generator:0#2", 8, log=log)
    try:
        deadline = time.monotonic() + 120
        while not arrived(store, "generator:0#2", 2):
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
            time.sleep(0.1)
        group = form_group(store, 0, 2, 120, torch.device("cpu"), "generator:0#2", connect_s=3)
        started = time.monotonic()
        total = torch.tensor([10.0, 20.0, 30.0])
        group.allreduce([total]).wait()  # (the peer sends after 8 s, past connect_s)
        assert time.monotonic() - started > 3
        assert total.tolist() == [11.0, 22.0, 33.0]
    finally:
        finish(proc, log_path)

