"""What weight sync sends: buckets in the generator's (checkpoint) layout, the probe; what vLLM can serve:
the head-size and KV-cache checks."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, example, write_config
from tests.unit.test_config import error_of
from toolkit.config.model_files import VLLM_CPU_HEAD_SIZES, head_dim, kv_cache_problem, vllm_cpu_problem
from toolkit.modeling import without_dropout
from toolkit.tiny import build_family, copy_tokenizer
from toolkit.weights import probe
from toolkit.weights.hf_format import checkpoint_converter
from toolkit.weights.sync import plan_layout


def test_mixture_of_experts_travels_in_the_checkpoint_layout():
    """transformers fuses each layer's experts in memory; vLLM loads one matrix per expert."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_family(REPO / "models" / "tiny-qwen2-moe", "qwen2-moe"))
    params = list(model.named_parameters())
    fused = [name for name, p in params if p.dim() == 3]
    assert fused, "transformers no longer fuses the experts: this test should change"
    layout = plan_layout(params, 64 * 1024, probe.probe_tokens(512, 0), checkpoint_converter(model))
    wire = [name for bucket in layout.wire for name, _, _ in bucket]
    assert not any(name in wire for name in fused)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in wire
    assert sum(len(s) for s in layout.sources) == len(params)
    # The same bytes: converting splits tensors, it adds or drops nothing.
    numel = lambda shapes: sum(torch.Size(s).numel() for s in shapes)  # noqa: E731
    assert numel(s for b in layout.wire for _, _, s in b) == sum(p.numel() for _, p in params)
    # A bucket's real tensors convert to exactly what the layout announced.
    index = next(i for i, b in enumerate(layout.wire) if any("experts.0." in n for n, _, _ in b))
    tensors = layout.converted(index, [params[i][1].data for i in layout.sources[index]])
    assert [list(t.shape) for t in tensors] == [s for _, _, s in layout.wire[index]]


def test_probe_check_names_the_generator_and_the_fix():
    expected = torch.zeros(31)
    assert probe.check(expected, expected + 1e-5, 1e-3, 4, "generator worker generator:0") < 1e-3
    with pytest.raises(probe.WeightSyncError) as info:
        probe.check(expected, expected + 0.2, 1e-3, 4, "generator worker generator:0 (vllm)")
    msg = str(info.value)
    assert "policy_version 4, generator worker generator:0 (vllm)" in msg and "0.2 > " in msg
    assert "rollout.sync_check_tolerance" in msg
    assert probe.probe_tokens(512, 3) == probe.probe_tokens(512, 3) and max(probe.probe_tokens(512, 3)) < 512
    # the trainer's own log-probs not finite: training diverged, which was reported as a failed sync ("look for
    # 'Failed to load weights'"); a generator's that are not finite still fail the sync
    with pytest.raises(probe.TrainingDiverged, match="policy_version 7, the trainer's own log-probs .* training "
                                                     "diverged .the weight sync is not at fault"):
        probe.check(torch.full((7,), float("nan")), torch.full((7,), float("nan")), 1e-3, 7, "generator worker g")
    with pytest.raises(probe.WeightSyncError):
        probe.check(expected, torch.full((31,), float("nan")), 1e-3, 7, "generator worker g")


def test_the_probe_is_computed_without_the_adapters_dropout():
    """peft makes a LoRA adapter's dropout (trainer.lora.dropout) in training mode inside a model loaded in eval
    mode: the trainer's probe log-probs were drawn with part of each adapter's input dropped, and differed from
    the merged model's (what vLLM gets) by more than the tolerance, failing exact syncs. Every mode is put back."""
    from transformers import AutoModelForCausalLM

    from toolkit.config.base import LoraSection
    from toolkit.training.lora import add_adapters, merged_state_dict

    path = REPO / "models" / "tiny" / "model"
    torch.manual_seed(0)
    model = add_adapters(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                         LoraSection(rank=8, dropout=0.05))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # (as after a few updates: B starts at 0)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    plain.load_state_dict(merged_state_dict(model))
    tokens = probe.probe_tokens(512, 1)
    modes = {name: m.training for name, m in model.named_modules()}
    assert any(modes.values()) and not all(modes.values())  # (the adapters' dropout trains, the rest does not)
    for _ in range(3):
        diff = float((probe.model_logprobs(model, tokens) - probe.model_logprobs(plain, tokens)).abs().mean())
        assert diff < 1e-5, diff
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_head_size_vllm_cannot_serve_on_cpu_is_a_config_error(tiny, tmp_path):
    model = tmp_path / "model16"
    model.mkdir()
    cfg = json.loads((tiny / "model" / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16}))
    copy_tokenizer(tiny / "model", model)
    assert head_dim(json.loads((model / "config.json").read_text())) == 16
    assert head_dim({"n_embd": 768, "n_head": 12}) == 64  # GPT-2 names, no head_dim
    msg = error_of(write_config(tmp_path, example("tiny-grpo.yaml", tiny, model={"actor": str(model)},
                                                  rollout={"backend": "vllm"})))
    assert "model.actor:" in msg and "attention heads of size 16" in msg and "rollout.backend: hf" in msg
    assert vllm_cpu_problem(tiny / "model") is None  # head size 64 is fine
    # the same model with the transformers engine is accepted
    write_config(tmp_path, example("tiny-grpo.yaml", tiny, model={"actor": str(model)}, rollout={"backend": "hf"}))


def test_a_kv_cache_too_small_for_one_sample_is_a_config_error_and_vllm_agrees(tiny, tmp_path):
    """vLLM checks its KV cache only after its worker has started and loaded the model; validation does the
    same sum first. Its bound is a lower one (vLLM rounds up to blocks): the real engine refuses it too."""
    tokens = 256 + 24  # the example's rollout.max_prompt_tokens + max_new_tokens
    need = tokens * 2 * 2 * 2 * 64 * 4  # 2 layers x (K, V) x 2 KV heads x head size 64 x 4 bytes (float32)
    msg = error_of(write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={
        "backend": "vllm", "vllm": {"kv_cache_gb": 0.99 * need / 2**30}})))
    assert "rollout.vllm.kv_cache_gb is 0.000529, but one sample of 280 tokens" in msg
    assert "needs at least 0.000534 GiB of KV cache" in msg and "2 layers x 2 x 2 KV heads x 64 x 4 bytes" in msg
    assert kv_cache_problem(tiny / "model", tokens, "float32", 1, need / 2**30) is None
    assert "needs at least 0.000267 GiB" in kv_cache_problem(tiny / "model", tokens, "bfloat16", 1, 1e-6)
    assert "1 KV heads" in kv_cache_problem(tiny / "model", tokens, "float32", 2, 1e-6)  # (split over TP ranks)
    # the transformers engine has no such cache
    write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={"backend": "hf", "vllm": {"kv_cache_gb": 1e-6}}))
    pytest.importorskip("vllm")
    script = ("import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\nfrom vllm import LLM\n"
              f"LLM(model={str(tiny / 'model')!r}, dtype='float32', max_model_len={tokens}, "
              f"kv_cache_memory_bytes={need}, enforce_eager=True)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result.stdout
    assert "To serve at least one request with the model's max seq len (280)" in result.stderr


def test_head_sizes_match_the_installed_vllm():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES


def test_dropout_is_turned_off_for_training():
    gpt2 = build_family(REPO / "models" / "tiny-gpt2-tied", "gpt2-tied")
    assert {"attn_pdrop", "embd_pdrop", "resid_pdrop"} <= set(without_dropout(gpt2))
    assert set(without_dropout(gpt2).values()) == {0.0}


def test_a_sync_group_takes_nccl_only_when_every_rank_has_a_gpu_of_its_own():
    from toolkit.weights.sync import sync_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sync_backend(cuda, ["GPU-a", "GPU-b", "GPU-c"]) == "nccl"
    assert sync_backend(cuda, ["GPU-a", "GPU-b", "GPU-a"]) == "gloo"  # (two ranks on one GPU: NCCL refuses them)
    assert sync_backend(cpu, ["None", "None"]) == "gloo"
    assert sync_backend(cuda, ["GPU-a", "None"]) == "gloo"  # (a generator on the CPU)


class StandInNccl:
    """Stands in for torch's ProcessGroupNCCL, which needs GPUs that no machine here has: it records how
    it was made, and its broadcasts' works record how they are waited for (or raise, as a dead peer's)."""

    class Options:
        pass

    def __init__(self, store=None, rank=0, size=2, options=None):
        self.error_handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        self.timeout = getattr(options, "_timeout", None)
        self.dead, self.waits = False, []  # (a test sets `dead` once the peer has died)
        self.sends: list[torch.Tensor] = []  # (what a receiver's broadcasts take in, in order, as from rank 0)

    def name(self):
        return "nccl"

    def broadcast(self, tensor, root):
        group = self
        if self.sends:
            tensor.copy_(self.sends.pop(0))

        class Work:
            def wait(self, timeout=None):
                group.waits.append(timeout)
                if group.dead:
                    raise RuntimeError("NCCL communicator was aborted (a stand-in's error)")
                return True

        return Work()


def test_an_nccl_sync_group_survives_its_peers_errors_and_leaves_the_environment_as_it_was(monkeypatch):
    """form_group makes an NCCL group with CleanUpOnly error handling (torch's default, SkipCleanUp, would
    end the trainer from NCCL's watchdog when a generator dies), set for that group alone."""
    import types

    from toolkit.transport.rendezvous import serve_store
    from toolkit.transport.wire import new_secret
    from toolkit.weights.sync import form_group

    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", StandInNccl, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="GPU-a"))
    store = serve_store("127.0.0.1", 30, new_secret())
    try:
        for before in (None, "3"):
            if before is None:
                monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
            else:
                monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", before)
            group = form_group(store, 0, 1, 42, torch.device("cuda", 0), f"g{before}")
            assert isinstance(group, StandInNccl) and group.error_handling == "2"
            assert group.timeout.total_seconds() == 42
            assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == before
    finally:
        store.close()


def test_the_sender_waits_for_nccl_transfers_within_the_timeout_and_drops_a_dead_receiver():
    """NCCL's wait() holds only the GPU stream and raises nothing: the sender waits with the group's
    timeout, so a dead generator's transfer raises, its group is dropped and the others go on."""
    from toolkit.weights.sync import SyncLayout, WeightSender

    layout = SyncLayout(["w"], [[0]], [[["w", "float32", [4]]]], [])
    sender = WeightSender(layout, torch.device("cpu"))
    alive, dead = StandInNccl(), StandInNccl()
    sender.add("alive", alive, 30)
    sender.add("dead", dead, 30)
    sender.add("untimed", StandInNccl())  # (no timeout given: waits as before)
    dead.dead = True
    sent = sender.send(1, [[torch.ones(4)]], lambda: None)
    assert sent == 16 and sender.names == ["alive", "untimed"] and sender.lost == ["dead"]
    assert set(alive.waits) == {datetime.timedelta(seconds=30)} and len(alive.waits) == 4  # (layout x2, version, bucket)
    assert dead.waits == [datetime.timedelta(seconds=30)] * 3  # (its layout, then the version that failed)
    assert sender.groups["untimed"].waits == [None] * 4


def test_the_receiver_waits_for_nccl_transfers_within_the_timeout_and_raises_when_one_fails():
    """The generator's side waits on the host with the group's timeout as the sender does: a transfer that
    fails or outlasts it raises from the receive, where without it the host would block at the first read of
    the tensor until NCCL's watchdog aborts the group, and then read what was half-written."""
    from toolkit.weights.sync import WeightReceiver

    def group():
        made = StandInNccl()
        layout = json.dumps({"buckets": [[["w", "float32", [4]]]], "probe": []}).encode()
        made.sends = [torch.tensor([len(layout)]), torch.frombuffer(bytearray(layout), dtype=torch.uint8),
                      torch.tensor([7]), torch.arange(4.0)]
        return made

    timed, untimed = group(), group()
    receivers = [WeightReceiver(timed, torch.device("cpu"), 30), WeightReceiver(untimed, torch.device("cpu"))]
    for receiver in receivers:
        version, tensors = receiver.receive()
        assert version == 7 and [(name, t.tolist()) for name, t in tensors] == [("w", [0, 1, 2, 3])]
    # (the layout's length and bytes, the version, the one bucket)
    assert timed.waits == [datetime.timedelta(seconds=30)] * 4 and untimed.waits == [None] * 4
    timed.dead = True
    with pytest.raises(RuntimeError, match="aborted"):
        receivers[0].receive()


def test_a_receiver_whose_trainer_stalls_says_what_did_not_come_and_why():
    """A generator whose trainer stalled in a sync failed with gloo's words alone ("Timed out waiting 2000ms for
    recv operation to complete"): no word of the weight sync, the trainer, or the setting that bounds the wait."""
    import threading
    import time

    import torch.distributed as dist

    from toolkit.weights.sync import SyncLayout, WeightReceiver, WeightSender

    store = dist.HashStore()
    groups = {}

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=2))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    layout = SyncLayout(["w"], [[0]], [[["w", "float32", [4]]]], [])
    sender = WeightSender(layout, torch.device("cpu"))
    adding = threading.Thread(target=sender.add, args=("g", groups[0]))
    adding.start()
    receiver = WeightReceiver(groups[1], torch.device("cpu"), 2)
    adding.join()
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        receiver.receive()  # (the trainer sends nothing more)
    assert time.monotonic() - started < 30
    assert str(info.value).startswith("weight sync: the next version's number did not come from trainer rank 0 "
                                      "within transport.step_timeout_s (2 s): the trainer ended, or stalled, during "
                                      "the sync (its log says which); "), str(info.value)
    assert "Timed out waiting 2000ms" in str(info.value)


def test_the_probe_thread_hands_back_its_log_probs_or_its_error():
    """The trainer computes the probe in a thread while the buckets travel (`Prober`): its result, or the
    exception it raised, reaches the sending thread."""
    from toolkit.weights.sync import Prober

    assert Prober(lambda: torch.ones(3), torch.device("cpu")).result().tolist() == [1, 1, 1]

    def broken():
        raise ValueError("no such layer")

    with pytest.raises(ValueError, match="no such layer"):
        Prober(broken, torch.device("cpu")).result()


def test_weights_that_lie_one_after_another_are_sent_without_a_copy():
    """A bucket of weights that are views of one flat buffer, in order (DeepSpeed ZeRO-1/2's parameters),
    travels as a view of that buffer; anything else (apart, out of order, another dtype, not contiguous)
    is copied into a send buffer (one weight alone, made contiguous). The receiver gets the same bytes
    either way, and `copied` counts the copies."""
    from toolkit.weights.sync import SyncLayout, WeightSender, span

    cpu = torch.device("cpu")
    flat = torch.arange(12.0)
    a, b, c = flat[:4].view(2, 2), flat[4:10], flat[10:]
    view = span([a, b, c], cpu)
    assert view is not None and view.data_ptr() == flat.data_ptr() and view.tolist() == flat.tolist()
    assert span([b, c], cpu).tolist() == flat[4:].tolist()
    assert span([a, c], cpu) is None and span([b, a], cpu) is None  # (a gap; out of order)
    assert span([a, flat[4:10].double()], cpu) is None and span([flat[:4], flat[4:].view(2, 4).t()], cpu) is None
    assert span([torch.arange(4.0), torch.arange(4.0)], cpu) is None  # (two storages)

    class Recording:
        def __init__(self):
            self.sent = []

        def name(self):
            return "gloo"

        def broadcast(self, tensor, root):
            self.sent.append((tensor.data_ptr(), tensor.clone()))
            return StandInNccl().broadcast(tensor, root)

    layout = SyncLayout(["a", "b", "c"], [[0, 1, 2]], [[["a", "float32", [2, 2]], ["b", "float32", [6]],
                                                        ["c", "float32", [2]]]], [])
    for tensors, shared in (([a, b, c], True), ([a.clone(), b.clone(), c.clone()], False)):
        group = Recording()
        sender = WeightSender(layout, cpu)
        sender.add("g", group)
        assert sender.send(1, [tensors], lambda: None) == 48
        pointer, bucket = group.sent[-1]
        assert bucket.tolist() == flat.tolist() and (pointer == flat.data_ptr()) == shared
        assert sender.copied == (0 if shared else 1)
    one = SyncLayout(["w"], [[0]], [[["w", "float32", [2, 3]]]], [])  # (a bucket of one weight)
    for weight, copied in ((flat[:6].view(2, 3), 0), (flat[:6].view(3, 2).t(), 1)):  # (in place; not contiguous)
        group = Recording()
        sender = WeightSender(one, cpu)
        sender.add("g", group)
        assert sender.send(1, [[weight]], lambda: None) == 24
        pointer, bucket = group.sent[-1]
        assert bucket.tolist() == weight.reshape(-1).tolist() and sender.copied == copied
        assert (pointer == flat.data_ptr()) == (copied == 0)
