"""MKL on this CPU as torch ships it, against MKL with its Intel kernels (`run.fast_mkl_on_amd`).

    python tools/bench_mkl.py [--repeats 3] [--micro-batches 4]

Each side runs in a fresh process with the allocator our workers take (`run.allocator: auto`); the second
also preloads the library of toolkit/launch/mkl_amd.py, as a worker on an AMD CPU does. Measured: fp32
`F.linear` of the shapes of tools/bench_trl.py's 26M Llama over one micro-batch (16 x 142 tokens), in
GFLOP/s; and that Llama's training of one step as bench_trl's trainer does it (4 micro-batches of 16,
forward, backward, AdamW; `--micro-batches` fewer for a quick check) and its scoring forward pass over the
same samples, in seconds (medians over
`--repeats` after a first, unmeasured round), with the largest difference of the losses between the two
sides. The last line is the ratio of the training times (as shipped / with the library).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TOKENS = 16 * 142  # (a micro-batch of bench_trl: 16 samples of a 14-token prompt and 128 new tokens)
SHAPES = [("attention q/k/v/o", 512, 512), ("MLP up/gate", 512, 1376), ("MLP down", 1376, 512)]

MEASURE = """
import json, statistics, sys, time, torch
from transformers import AutoModelForCausalLM
model_dir, repeats, tokens, shapes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
samples = 16 * int(sys.argv[5])
out = {"linear": {}}
for name, k, n in shapes:
    x, w = torch.randn(tokens, k), torch.randn(n, k)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(5 * repeats):
        t = time.perf_counter(); torch.nn.functional.linear(x, w); times.append(time.perf_counter() - t)
    out["linear"][name] = 2 * tokens * k * n / statistics.median(times) / 1e9
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(5, 500, (samples, tokens // 16))
train, score, losses = [], [], []
for r in range(repeats + 1):
    t = time.perf_counter()
    for i in range(0, samples, 16):
        logp = torch.log_softmax(model(input_ids=ids[i:i + 16]).logits, -1)[:, :-1]
        loss = -logp.gather(-1, ids[i:i + 16, 1:, None]).mean()
        loss.backward()
        losses.append(loss.item())
    optimizer.step(); optimizer.zero_grad()
    t1 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, samples, 16):
            model(input_ids=ids[i:i + 16])
    if r:
        train.append(t1 - t); score.append(time.perf_counter() - t1)
out.update(train_s=statistics.median(train), score_s=statistics.median(score), losses=losses)
print(json.dumps(out))
"""


def measure(model: Path, repeats: int, micro_batches: int, preload: list[str]) -> dict:
    env = {**os.environ, "LD_PRELOAD": " ".join(preload)}
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(model), str(repeats), str(TOKENS), json.dumps(SHAPES),
                           str(micro_batches)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds of each side (after a first one)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches of 16 samples in the measured "
                        "training step and scoring pass (default 4: bench_trl's step of 64 samples)")
    args = parser.parse_args()
    for name in ("repeats", "micro_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")

    from bench_trl import build_model

    from toolkit.launch import mkl_amd
    from toolkit.launch.allocator import choice
    from toolkit.table import text_table
    from toolkit.tiny import build_tiny

    library, why = mkl_amd.library()
    if library is None:
        print(f"bench_mkl: nothing to compare here: {why}")
        return 0
    allocator = [lib for lib in (choice("auto")[1],) if lib]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        build_model(build_tiny(tmp / "tiny"), tmp / "model")
        shipped = measure(tmp / "model", args.repeats, args.micro_batches, allocator)
        fast = measure(tmp / "model", args.repeats, args.micro_batches, [*allocator, library])
    rows = [("measure", "as shipped", "Intel kernels", "ratio")]
    for name, k, n in SHAPES:
        rows.append((f"F.linear {name} ({TOKENS}x{k} by {k}x{n}), GFLOP/s", f"{shipped['linear'][name]:.1f}",
                     f"{fast['linear'][name]:.1f}", f"{fast['linear'][name] / shipped['linear'][name]:.2f}"))
    n = args.micro_batches
    for key, label in (("train_s", f"training step of the 26M Llama ({n} x 16 samples), s"),
                       ("score_s", f"scoring forward pass ({n} x 16 samples), s")):
        rows.append((label, f"{shipped[key]:.2f}", f"{fast[key]:.2f}", f"{shipped[key] / fast[key]:.2f}"))
    diff = max(abs(a - b) for a, b in zip(shipped["losses"], fast["losses"]))
    print(f"MKL on {os.cpu_count()} cores of this CPU, fp32; {args.repeats} rounds measured; "
          f"largest loss difference {diff:.2e}")
    print(text_table(rows))
    print(f"ratio {shipped['train_s'] / fast['train_s']:.2f}  (training step as shipped / with MKL's Intel kernels)")
    return 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
