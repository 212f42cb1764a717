"""The TRL side of tools/bench_trl.py: TRL's GRPOTrainer on the benchmark's model and workload. It runs in
TRL's own virtual environment (bench_trl.py makes it), so it imports nothing of slurm-rlhf but the reward.

    python tools/trl_grpo.py MODEL_DIR PROMPTS_JSONL STEPS OUT_JSON [--free MAX_NEW_TOKENS] [--checkpointing]

Writes {"step_s": [seconds of each optimizer step], "generate_s", "score_s": [seconds of each step in
TRL's generation, and in the rest of its `_generate_and_score_completions` (reference log-probs,
rewards, advantages)], "response_len": [mean completion length of each step], "trl": version}; the rest
of a step is training. One optimizer step takes 64 samples (16 prompts x 4) in 4 micro-batches of 16,
generates them once (transformers `generate`, forced to 128 new tokens; with `--free`, up to MAX_NEW_TOKENS
and ending at end-of-sequence), and keeps a reference model for the KL term (beta 0.04), as the
slurm-rlhf side does. `--checkpointing`: activation (gradient) checkpointing on, as GRPOConfig has it
by default (TRL 1.16); without it, off, as slurm-rlhf trains by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("prompts")
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("--free", type=int, metavar="MAX_NEW_TOKENS",
                        help="responses end at end-of-sequence, up to this many tokens (default: 128, forced)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (TRL's default)")
    args = parser.parse_args()
    max_new, forced = (args.free, False) if args.free else (128, True)
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from toolkit.rewards.examples import digit_ratio

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])

    def reward(prompts, completions, **kwargs):
        return [digit_ratio(p, c) for p, c in zip(prompts, completions)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.last, self.steps, self.lengths = None, [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.steps.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    clock = Clock()
    phases = {"generate_s": [], "score_s": []}

    def timed(method, key, inner=None):
        """`method`, its seconds appended to phases[key] (less those of `inner` in the same call)."""
        def call(*args, **kwargs):
            before = sum(phases[inner]) if inner else 0.0
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                phases[key].append(time.perf_counter() - start - ((sum(phases[inner]) - before) if inner else 0.0))
        return call

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(output_dir=tmp, per_device_train_batch_size=16, gradient_accumulation_steps=4,
                            num_generations=4, max_completion_length=max_new, beta=0.04, learning_rate=1e-5,
                            temperature=1.0, top_p=1.0, top_k=0, num_iterations=1, max_steps=args.steps,
                            generation_kwargs={"min_new_tokens": 128} if forced else {}, logging_steps=1, report_to=[],
                            save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=0, shuffle_dataset=False,
                            disable_dropout=True, dataloader_num_workers=0, lr_scheduler_type="constant",
                            gradient_checkpointing=args.checkpointing)
        trainer = GRPOTrainer(model=args.model_dir, reward_funcs=reward, args=config, train_dataset=dataset,
                              callbacks=[clock])
        # (one generation of all 64 samples per optimizer step: steps_per_generation = the accumulation steps)
        trainer._generate = timed(trainer._generate, "generate_s")
        trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "score_s",
                                                        inner="generate_s")
        trainer.train()
    result = {"step_s": clock.steps, **phases, "response_len": clock.lengths, "trl": trl.__version__}
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
