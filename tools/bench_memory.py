"""The memory switches side by side: what each saves, and that the training result stays the same.

    python tools/bench_memory.py [--hidden 512 --layers 8 --heads 8 --intermediate 1376]
                                 [--batch 8 --seq 256 --steps 4] [--jobs 1] [--json OUT]
    python tools/bench_memory.py --config tests/fixtures/model_configs/Qwen--Qwen2.5-0.5B.json \
                                 --batch 8 --seq 1024          (on a GPU: bf16, peak GPU memory, MFU)

Builds a random Llama of the given shape (the tiny tokenizer's 512 vocab), or a model of a public
architecture from its `config.json` (`--config`), then trains it for a few steps on the same random tokens
through `toolkit.training.engine.build_engine` (the engine every stage uses), once per setting, each in a
fresh process (the baseline first, then `--jobs` at a time), on `--device` (cuda where there is one) in
`--dtype` (bf16 mixed precision on a GPU):

    baseline              ZeRO-2, every weight trained
    checkpointing         + trainer.gradient_checkpointing
    offload_optimizer     + trainer.offload_optimizer (ZeRO-Offload, DeepSpeed's CPU Adam)
    zero3_offload         ZeRO-3 + offload_optimizer + offload_params
    lora                  trainer.lora (rank 8, every linear layer)
    lora+checkpointing    both
    eager_attention       model.attn_implementation: eager (the baseline uses sdpa)

Figures per setting: trainable parameters; bytes of the optimizer's states; bytes of the activations
autograd keeps for the backward pass of one micro-batch (counted by a saved-tensors hook, each storage
once); the process's peak resident memory (its own high-water mark: on a CPU machine the device memory
is host memory, so offloading moves nothing there, and shows in this column only on a GPU); the median
step time; and the largest difference of the per-step losses from the baseline's (LoRA trains other
weights, so its losses differ after the first step by design; its first loss must be the baseline's).
On a GPU also the peak GPU memory (`torch.cuda.max_memory_allocated`) and the model FLOPs utilisation:
model FLOPs of a step over its time over `--peak-tflops` (989: an H100's or H200's dense bf16). Model
FLOPs per token: 6 per weight of every linear layer (the LM head too) plus 12 x layers x sequence x
attention width for the attention scores, as in PaLM's appendix; a frozen weight (LoRA's base) counts 4,
since no gradient of it is computed (the attention scores count 12 with LoRA too: they have no weights, and the
gradients of both their inputs flow on to the adapters); recomputation (activation checkpointing) is not counted, as MFU
does not count it. The ratio of each figure to the baseline's comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETTINGS = {
    "baseline": {},
    "checkpointing": {"engine": {"gradient_checkpointing": True}},
    "offload_optimizer": {"engine": {"offload_optimizer": True}},
    "zero3_offload": {"engine": {"zero_stage": 3, "offload_optimizer": True, "offload_params": True}},
    "lora": {"engine": {"lora": {"rank": 8}}},
    "lora+checkpointing": {"engine": {"lora": {"rank": 8}, "gradient_checkpointing": True}},
    "eager_attention": {"attention": "eager"},
}


def build_model(directory: Path, args) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    if args.config:
        fields = json.loads(Path(args.config).read_text())
        for key in ("torch_dtype", "dtype", "transformers_version"):  # (--dtype decides; not config fields)
            fields.pop(key, None)
        config = AutoConfig.for_model(**fields)
    else:
        config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=args.heads, num_key_value_heads=args.heads,
                             intermediate_size=args.intermediate, max_position_embeddings=max(512, args.seq),
                             tie_word_embeddings=False)
    torch.set_num_threads(os.cpu_count() or 1)
    AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype)).save_pretrained(directory)


def flops_per_token(model, seq: int, lora: bool) -> float:
    """Model FLOPs of one trained token (see the module's docstring)."""
    import torch

    linear = sum(getattr(m.weight, "ds_numel", m.weight.numel()) for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lora_" not in name)  # (ds_numel: the whole of a ZeRO-3 one)
    config = model.config
    width = config.num_attention_heads * (getattr(config, "head_dim", None)
                                          or config.hidden_size // config.num_attention_heads)
    per_weight = 4 if lora else 6
    return per_weight * linear + 12 * config.num_hidden_layers * seq * width


def one(name: str, model_dir: str, args) -> dict:
    """Train with setting `name` in this process; its figures."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.config.base import EngineSection
    from toolkit.modeling import pretrained_kwargs
    from toolkit.training.engine import build_engine
    from toolkit.training.lora import parameter_counts
    from toolkit.training.ranks import alone

    setting = SETTINGS[name]
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, **pretrained_kwargs(model_dir, getattr(torch, args.dtype), setting.get("attention", "sdpa")))
    engine_settings = {"zero_stage": 2, "lr": 1e-3, "micro_batch_size": args.batch, **setting.get("engine", {})}
    settings = EngineSection(**engine_settings)
    alone(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    engine = build_engine(model, settings, settings.lr, args.dtype, 1, 1, lora=settings.lora)
    trainable, total = parameter_counts(engine.module)
    cuda = engine.device.type == "cuda"
    flops = flops_per_token(engine.module, args.seq, settings.lora is not None) * args.batch * args.seq
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=generator).to(engine.device)
               for _ in range(args.steps)]

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type != "meta":
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    losses, seconds = [], []
    engine.train()
    for i, ids in enumerate(batches):
        started = time.perf_counter()
        if i == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = engine(input_ids=ids, labels=ids).loss
        else:
            loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
    state_bytes = 0
    for optimizer in _optimizers(engine.optimizer):
        for state in optimizer.state.values():
            state_bytes += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim())
    step_s = statistics.median(seconds[1:] or seconds)
    return {"setting": name, "trainable": trainable, "total": total, "optimizer_state_bytes": state_bytes,
            "saved_activation_bytes": sum(saved.values()),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_device_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "mfu": flops / step_s / (args.peak_tflops * 1e12) if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": args.dtype,
            "step_s": step_s, "losses": losses,
            "skipped_steps": int(getattr(engine, "skipped_steps", 0)),  # (fp16: steps dropped on an overflow)
            "reduce_bucket": getattr(engine.optimizer, "reduce_bucket_size", None),  # (ZeRO's, in elements)
            "optimizer": type(engine.optimizer).__name__ + "/" + type(_optimizers(engine.optimizer)[0]).__name__}


def _optimizers(optimizer) -> list:
    """The torch optimizer(s) under DeepSpeed's ZeRO wrapper (which keeps the states)."""
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else [optimizer]


def measure(args, names: list[str]) -> list[dict]:
    """Every setting in a fresh process (a process's peak memory is its own): the baseline, then the others
    `args.jobs` at a time."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir, args)
        results = [measure_one(args, names[0], model_dir)]
        if "failed" in results[0]:
            raise SystemExit("bench_memory: the baseline failed; nothing to compare with")
        with ThreadPoolExecutor(args.jobs) as pool:
            results += pool.map(lambda name: measure_one(args, name, model_dir), names[1:])
    return results


def measure_one(args, name: str, model_dir: Path) -> dict:
    """Setting `name` measured in a process of its own: its figures, or {"setting", "failed": exit code}."""
    env = {"TORCH_EXTENSIONS_DIR": os.path.join(sys.prefix, "torch_extensions"),  # where setup built the ops
           **os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {})}
    command = [sys.executable, __file__, "--one", name, "--model-dir", str(model_dir), *_shape(args)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:  # (named in the table; the others still run)
        print(f"bench_memory: setting {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
        return {"setting": name, "failed": done.returncode}
    r = json.loads(lines[-1])  # (as each setting ends: a run cut short by a time limit still shows what it measured)
    print(f"{name}: step {r['step_s']:.3f} s, peak RSS {r['peak_rss_mb']:.0f} MB"
          + (f", peak GPU {r['peak_device_mb']:.0f} MB" if r["peak_device_mb"] is not None else ""), file=sys.stderr)
    return r


def _shape(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("hidden", "layers", "heads", "intermediate", "batch", "seq", "steps", "threads", "device", "dtype",
             "peak_tflops")] + ([f"--config={args.config}"] if args.config else [])


def table(results: list[dict]) -> str:
    from toolkit.table import text_table

    base = results[0]
    gpu = base["peak_device_mb"] is not None
    fp16 = base["dtype"] == "float16"
    rows = [("setting", "trainable", "optimizer states MB", "activations MB", "peak RSS MB",
             *(("peak GPU MB", "MFU") if gpu else ()), "step s", *(("skipped steps",) if fp16 else ()),
             "max loss diff", "activations ratio",
             *(("GPU memory ratio",) if gpu else ()), "step ratio")]
    for r in results:
        if "failed" in r:
            rows.append((r["setting"], f"failed (exit {r['failed']}): see stderr", *[""] * (len(rows[0]) - 2)))
            continue
        same_weights = not r["setting"].startswith("lora")
        diffs = [abs(a - b) for a, b in zip(r["losses"], base["losses"])]
        diff = max(diffs) if same_weights else diffs[0]
        rows.append((r["setting"], f"{r['trainable']:,}", f"{r['optimizer_state_bytes'] / 2**20:.1f}",
                     f"{r['saved_activation_bytes'] / 2**20:.1f}", f"{r['peak_rss_mb']:.0f}",
                     *((f"{r['peak_device_mb']:.0f}", f"{r['mfu']:.1%}") if gpu else ()), f"{r['step_s']:.3f}",
                     *((str(r["skipped_steps"]),) if fp16 else ()),
                     f"{diff:.1e}" + ("" if same_weights else " (first)"),
                     f"{r['saved_activation_bytes'] / base['saved_activation_bytes']:.2f}",
                     *((f"{r['peak_device_mb'] / base['peak_device_mb']:.2f}",) if gpu else ()),
                     f"{r['step_s'] / base['step_s']:.2f}"))
    return text_table(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", help="a model's config.json to build (random weights) instead of the Llama shape")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda where there is one")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="default: bfloat16 on cuda (mixed precision), float32 on cpu; float16: DeepSpeed's "
                             "fp16 mode (fp32 master weights, dynamic loss scaling)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense peak, for MFU")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset, baseline first")
    parser.add_argument("--jobs", type=int, default=1,
                        help="settings measured at once after the baseline (each in a process of its own, so its "
                             "peak memory is its own; their step times then share the machine)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.one:
        print(json.dumps(one(args.one, args.model_dir, args)))
        return 0
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or names[0] != "baseline":
        parser.error(f"--settings: known settings are {', '.join(SETTINGS)}, baseline first")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: at least 1")
    results = measure(args, names)
    shape = (f"{Path(args.config).stem}'s config" if args.config else
             f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, intermediate {args.intermediate}")
    print(f"{shape}; {results[0]['total'] / 1e6:.1f}M parameters; micro-batch {args.batch} x {args.seq} tokens, "
          f"{args.steps} steps, {args.dtype} on {results[0]['device']}")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any("failed" in r for r in results) else 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
