"""How fast the planner searches large clusters: seconds, peak memory and plans estimated per cluster size.

    python tools/bench_planner.py [--nodes 16,128,1024] [--models 70b,7b]

Each row is `placement.planner.search` in a fresh process (so the peak resident memory is that search's
process alone, Python and imports included) on N nodes of 8 H100-80GB (templates/clusters/2x8-h100.yaml
with `nodes` set to N), for a PPO step with actor, critic, reference and reward model of one size
(Llama-2's config.json from tests/fixtures/model_configs), bf16, 1,024 samples of 1,024 prompt + 1,024
response tokens, activation checkpointing on. Columns: the plans weighed (each layout with its trainer's
best setting), those that fit, those estimated whole (the others are bounded out: see `search`). The
last line: the slowest search and the largest peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MODELS = {"70b": "meta-llama--Llama-2-70b-hf.json", "7b": "meta-llama--Llama-2-7b-hf.json"}


def one(nodes: int, model: str) -> dict:
    from toolkit.placement.cluster import load_cluster
    from toolkit.placement.cost import ModelShape, Switches, Workload
    from toolkit.placement.planner import search

    shape = ModelShape.from_config(REPO / "tests/fixtures/model_configs" / MODELS[model])
    w = Workload(actor=shape, reference=shape, critic=shape, reward_models=(shape,), samples=1024, prompts=1024,
                 prompt_tokens=1024, response_tokens=1024, dtype_bytes=2, switches=Switches(checkpointing=True))
    cluster = load_cluster(REPO / "templates/clusters/2x8-h100.yaml").model_copy(update={"nodes": nodes})
    started = time.perf_counter()
    found = search(cluster, w, zero_stage=3)
    seconds = time.perf_counter() - started
    best = found.fit[0] if found.fit else None
    closest = found.rejected[0].estimate if found.rejected else None
    over = ", ".join(f"{name} {need / 1e9:.0f} GB" for name, need in closest.memory.items()
                     if need > cluster.device.memory_gb * 1e9) if closest else ""
    return {"seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "plans": found.fitting + found.not_fitting, "estimated": found.estimated, "fitting": found.fitting,
            "best": (f"{best.setting.strategy} {best.setting.describe()} TP{best.setting.tensor_parallel} "
                     f"ZeRO-{best.setting.zero_stage} mb {best.setting.micro_batch}"
                     f"{' offload' * best.setting.offload}: {best.estimate.step_s:.1f} s"
                     if best else f"none fits (closest: {over} per device of {cluster.device.memory_gb:g} GB)")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="16,128,1024")
    parser.add_argument("--models", default="70b,7b")
    parser.add_argument("--one", nargs=2, metavar=("NODES", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1])))
        return 0
    sizes = [n.strip() for n in args.nodes.split(",")]
    bad = next((n for n in sizes if not (n.isdigit() and int(n) >= 1)), None)
    if bad is not None:
        parser.error(f"--nodes {args.nodes}: {bad!r} is not a number of nodes; give whole numbers from 1, "
                     "comma-separated (e.g. 16,128)")
    models = [m.strip() for m in args.models.split(",")]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models {args.models}: no model {', '.join(unknown)}; the models are {', '.join(MODELS)} "
                     "(Llama-2's configs in tests/fixtures/model_configs)")

    from toolkit.launch.forkserver import die_with_parent
    from toolkit.table import text_table

    rows = [("model (PPO x4)", "nodes", "GPUs", "plans", "fit", "estimated", "search s", "peak MB", "best plan")]
    slowest, largest = 0.0, 0.0
    for model in models:
        for nodes in map(int, sizes):
            # (each search in a process of its own, for its peak memory; it ends with this tool however this one
            # ends: a SIGTERM while the search was being started left it running on)
            out = subprocess.run([sys.executable, __file__, "--one", str(nodes), model], capture_output=True,
                                 text=True, check=True, preexec_fn=die_with_parent).stdout
            r = json.loads(out)
            slowest, largest = max(slowest, r["seconds"]), max(largest, r["peak_mb"])
            rows.append((f"Llama-2-{model.upper()}", str(nodes), str(nodes * 8), str(r["plans"]), str(r["fitting"]),
                         str(r["estimated"]), f"{r['seconds']:.2f}", f"{r['peak_mb']:.0f}", r["best"]))
    print(text_table(rows))
    print(f"slowest search {slowest:.2f} s, largest peak {largest:.0f} MB")
    return 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
