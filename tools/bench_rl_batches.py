"""RL training micro-batches on samples of very different lengths: `micro_batch_size` rows against a
token budget (`trainer.micro_batch_tokens`), padded and packed (`model.packing`), side by side.

    python tools/bench_rl_batches.py [--samples 64 --rows 16 --prompt 32 --min-response 8 --max-response 480]

The random 26M-parameter Llama of tools/bench_memory.py trains GRPO updates (`toolkit.roles.update.train_on`,
DeepSpeed ZeRO-2, fp32, one rank) on the same experience: `--samples` samples with a `--prompt`-token
prompt and a response of uniformly random length, one optimizer step over all of them. Once in
micro-batches of `--rows` rows in arrival order, each padded to its longest; once by a token budget of
`--rows` x the longest possible sample (the same peak memory per micro-batch), padded to each
micro-batch's longest; once by the same budget packed, each micro-batch one sequence of its samples' own
tokens. Figures: micro-batches, the share of computed positions that are padding, the median seconds of
an update over the repeats (after one warm-up), the largest difference of the packed run's weights after
the warm-up update from the padded token budget's, and the ratio (rows / packed) last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--min-response", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from bench_scoring import check_sizes

    check_sizes(parser, args, ("samples", "rows", "prompt", "min_response", "repeats"))
    if args.samples % 4 or args.samples % args.rows:
        parser.error(f"--samples {args.samples}: give a multiple of 4 (the GRPO groups' size) and of --rows "
                     f"{args.rows} (a step's micro-batches), e.g. {4 * args.rows}")
    from toolkit.launch.preload import as_a_worker, describe

    as_a_worker()  # (what a worker preloads: tcmalloc, MKL's library on AMD)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from bench_memory import build_model
    from bench_scoring import Samples
    from toolkit.config import load_config
    from toolkit.modeling import pad_samples
    from toolkit.roles.update import Experience, micro_batches, train_on
    from toolkit.table import text_table
    from toolkit.tiny import build_tokenizer
    from toolkit.training.engine import build_engine
    from toolkit.training.ranks import alone

    alone(torch.device("cpu"))

    longest = args.prompt + args.max_response
    shape = argparse.Namespace(hidden=512, layers=8, heads=8, intermediate=1376, seq=longest, config=None,
                               dtype="float32")
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_response, args.max_response + 1, args.samples)
    padded = pad_samples(Samples([rng.integers(0, 512, args.prompt) for _ in lengths],
                                 [rng.integers(0, 512, n) for n in lengths]), 0)
    mask = padded.action_mask
    advantages = torch.from_numpy(rng.standard_normal(args.samples).astype(np.float32))[:, None] * mask
    ref = -torch.rand(mask.shape) * mask

    def experience() -> Experience:
        return Experience(padded, None, ref, ref.clone(), advantages)

    budget = args.rows * longest
    # name: (trainer.micro_batch_tokens, model.packing)
    runs = {"rows": (None, False), "token budget": (budget, False), "packed": (budget, True)}
    results, weights = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp) / "model", shape)
        build_tokenizer(Path(tmp) / "model")  # (a run's config needs one; these updates read none)
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text('{"prompt": "unused"}\n')
        for name, (tokens, packing) in runs.items():
            config = {"run": {"name": "bench", "algorithm": "grpo", "steps": 1},
                      "data": {"prompts": str(prompts)},
                      "model": {"actor": str(Path(tmp) / "model"), "packing": packing},
                      "rollout": {"prompts_per_step": args.samples // 4, "group_size": 4,
                                  "max_prompt_tokens": args.prompt, "max_new_tokens": args.max_response},
                      "reward": {"functions": [{"function": "toolkit.rewards.examples:digit_ratio"}]},
                      "trainer": {"micro_batch_size": args.rows, "micro_batch_tokens": tokens, "lr": 1e-5}}
            (Path(tmp) / f"{name}.yaml").write_text(yaml.safe_dump(config))
            cfg = load_config(Path(tmp) / f"{name}.yaml")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "model")
            engine = build_engine(model, cfg.trainer, cfg.trainer.lr, "float32", 1, args.samples // args.rows)
            plan = micro_batches(experience(), torch.arange(args.samples), cfg, lambda n: n)[0]
            real = int(padded.attention_mask.sum())
            computed = real if packing else sum(len(b) * int(padded.attention_mask[b].sum(1).max()) for b in plan)
            rng_shuffle = torch.Generator().manual_seed(0)
            train_on(experience(), engine, None, cfg, rng_shuffle)  # warm-up
            weights[name] = [p.detach().clone() for p in engine.module.parameters()]
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                train_on(experience(), engine, None, cfg, rng_shuffle)
                times.append(time.perf_counter() - started)
            results[name] = (len(plan), 1 - real / computed, statistics.median(times), max(map(len, plan)))
            del engine, model

    rows = [("micro-batches", "count", "most rows", "padding", "update s (median)", "weights diff")]
    labels = {"rows": f"{args.rows} rows each", "token budget": f"token budget {budget}",
              "packed": f"token budget {budget}, packed"}
    for name, (count, padding, seconds, most) in results.items():
        diff = ""
        if name == "packed":
            diff = f"{max((a - b).abs().max().item() for a, b in zip(weights[name], weights['token budget'])):.1e}"
        rows.append((labels[name], str(count), str(most), f"{padding:.0%}", f"{seconds:.2f}", diff))
    print(f"GRPO update of {args.samples} samples: prompt {args.prompt} tokens, responses {args.min_response}-"
          f"{args.max_response} tokens; 26M-parameter Llama, ZeRO-2, fp32, {torch.get_num_threads()} threads; "
          f"{describe()}")
    print(text_table(rows))
    print(f"ratio {results['rows'][2] / results['packed'][2]:.2f}  (rows / packed; rows / padded token budget "
          f"{results['rows'][2] / results['token budget'][2]:.2f})")
    return 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
