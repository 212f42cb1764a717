"""No-gradient forward passes (reference log-probs, old log-probs, values) on samples of very different
lengths: in arrival order against grouped by length, padded and packed, side by side.

    python tools/bench_scoring.py [--samples 64 --batch 16 --prompt 32 --min-response 8 --max-response 480]

The same random 26M-parameter Llama as tools/bench_memory.py scores the same samples (a 32-token prompt
and a response of uniformly random length) three times, by `toolkit.modeling.sequence_logprobs`: once
in passes of `--batch` consecutive samples, each padded to its longest (what scoring did before), once
grouped by length (`by_length`, the default), and once grouped by length and each pass packed into one
sequence (`model.packing`). Figures: the share of computed positions that are padding, the median time
of 3 repetitions, the largest difference of the log-probs from the first's, and the ratio (in order /
packed) last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))


class Samples:
    """The token fields of a SampleBatch that padding reads."""

    def __init__(self, prompts, responses):
        import numpy as np

        self.prompts, self.responses = prompts, responses
        self.prompt_offsets = np.cumsum([0] + [len(p) for p in prompts])
        self.response_offsets = np.cumsum([0] + [len(r) for r in responses])

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt(self, i):
        return self.prompts[i]

    def response(self, i):
        return self.responses[i]


def check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, counts: tuple[str, ...]) -> None:
    """parser.error (the usage, exit 2) for a size that failed later with a traceback: a count in `counts`
    (argument names) below 1, or a response length range that is empty (numpy's `low >= high`)."""
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if args.max_response < args.min_response:
        parser.error(f"--max-response {args.max_response} is below --min-response {args.min_response}: the "
                     "responses' lengths are drawn between them; give a maximum at least the minimum")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--min-response", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    check_sizes(parser, args, ("samples", "batch", "prompt", "min_response", "repeats"))
    from toolkit.launch.preload import as_a_worker, describe

    as_a_worker()  # (what a worker preloads: tcmalloc, MKL's library on AMD)

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from bench_memory import build_model
    from toolkit.modeling import by_length, pad_samples, sequence_logprobs, token_logprobs
    from toolkit.table import text_table

    shape = argparse.Namespace(hidden=512, layers=8, heads=8, intermediate=1376, seq=args.prompt + args.max_response,
                               config=None, dtype="float32")
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_response, args.max_response + 1, args.samples)
    padded = pad_samples(Samples([rng.integers(0, 512, args.prompt) for _ in lengths],
                                 [rng.integers(0, 512, n) for n in lengths]), 0)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp) / "model", shape)
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "model").eval()

    def in_order():
        def fn(m, ids, attention):
            return token_logprobs(m(input_ids=ids, attention_mask=attention, use_cache=False).logits, ids, 1.0)
        out = torch.zeros_like(padded.action_mask)
        with torch.no_grad():
            for start in range(0, len(padded), args.batch):
                index = torch.arange(start, min(start + args.batch, len(padded)))
                part = padded.rows(index)
                values = fn(model, part.input_ids, part.attention_mask)
                out[index, : values.shape[1]] = values
        return out * padded.action_mask

    def grouped():
        return sequence_logprobs(model, padded, 1.0, args.batch)

    def packed():
        return sequence_logprobs(model, padded, 1.0, args.batch, packing=True)

    def padding(groups) -> float:
        real = sum(int(padded.attention_mask[i].sum()) for g in groups for i in g)
        computed = sum(len(g) * int(padded.attention_mask[g].sum(1).max()) for g in groups)
        return 1 - real / computed

    order_groups = [list(range(s, min(s + args.batch, len(padded)))) for s in range(0, len(padded), args.batch)]
    length_groups = [g.tolist() for g in by_length(padded.attention_mask.sum(1), args.batch)]
    results = {}
    for name, fn in (("in order", in_order), ("by length", grouped), ("by length, packed", packed)):
        fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            values = fn()
            times.append(time.perf_counter() - started)
        results[name] = (statistics.median(times), values)
    def diff(name: str) -> str:
        return f"{(results['in order'][1] - results[name][1]).abs().max().item():.1e}"

    rows = [("order", "passes", "padding", "seconds (median)", "max log-prob diff")]
    rows.append(("in order", str(len(order_groups)), f"{padding(order_groups):.0%}", f"{results['in order'][0]:.2f}", ""))
    rows.append(("by length", str(len(length_groups)), f"{padding(length_groups):.0%}", f"{results['by length'][0]:.2f}",
                 diff("by length")))
    rows.append(("by length, packed", str(len(length_groups)), "0%", f"{results['by length, packed'][0]:.2f}",
                 diff("by length, packed")))
    print(f"{args.samples} samples: prompt {args.prompt} tokens, responses {args.min_response}-{args.max_response} "
          f"tokens; forward passes of {args.batch}; 26M-parameter Llama, fp32, {torch.get_num_threads()} threads; "
          f"{describe()}")
    print(text_table(rows))
    print(f"ratio {results['in order'][0] / results['by length, packed'][0]:.2f}  (in order / packed; in order / by "
          f"length {results['in order'][0] / results['by length'][0]:.2f})")
    return 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
