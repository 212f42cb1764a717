"""The planner against published RLHF runs: its step time beside the published one, run by run.

    python tools/published_runs.py [--runs tests/fixtures/published_runs.yaml]

Each run of the file (a published figure with its source and the text that gives it) is set up for the
planner: its models' config.json files (tests/fixtures/model_configs), the cluster file with the run's
node count, its workload, and the layout the source describes (`layout.strategy`, with the generation
engine it used, and `layout.tensor_parallel` where the source sets its generation's TP size, as
DeepSpeed-Chat's `--inference_tp_size` or NeMo-RL's Generation [TP,PP] (a generator of its own: the
fastest plan of that size, whose groups are formed for it), and `layout.offload` where the source moves models to host
memory between phases, as DeepSpeed-Chat's `--offload_reference_model`; off where it does not say). The
prediction is the fastest plan of that layout that fits (the planner chooses ZeRO stage, micro-batch and
TP size, as the publishers tuned theirs), with the per-GPU batch sizes the source states where it does
(`settings`); the source's own split of the step (`phases`) is printed beside ours. Pairs of runs of one
workload on the same hardware are ranked both ways. The last line: how many runs are predicted within 25%,
and the largest error, leaving out runs that set a rate of the cluster files (`calibrates`), since they
cannot check it.

`--set SECTION.FIELD=VALUE` (repeatable) changes a rate of every cluster file for this table, to see what a
rate does to each prediction, e.g. `--set overheads.decode_step_hf=0.025` (the figures in the cluster
files' comments come from such runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CONFIGS = REPO / "tests" / "fixtures" / "model_configs"
CLUSTERS = REPO / "templates" / "clusters"


def predict(run: dict, rates: dict | None = None):
    """(the best plan of the run's layout as the planner estimates it, or None, the search). Where the
    source states its batch sizes (`settings`), the plan takes them, and the prediction is made even if
    the planner's memory model finds that they do not fit (closest plan; said in its estimate's `short`).
    `rates`: {"section.field": value} in place of the cluster file's."""
    from toolkit.placement.cluster import load_cluster
    from toolkit.placement.cost import ModelShape, Switches, Workload, estimate
    from toolkit.placement.planner import search

    models = {role: ModelShape.from_config(CONFIGS / name) for role, name in run["models"].items()}
    load = run["workload"]
    w = Workload(actor=models["actor"], reference=models.get("reference", models["actor"]),
                 critic=models.get("critic"), reward_models=(models["reward"],) if "reward" in models else (),
                 samples=load["prompts"] * load["group_size"], prompts=load["prompts"],
                 prompt_tokens=load["prompt_tokens"], response_tokens=load["response_tokens"],
                 dtype_bytes=load["dtype_bytes"], updates_per_step=load.get("updates_per_step", 1),
                 switches=Switches(**run.get("switches", {})), max_policy_lag=run["layout"].get("max_policy_lag", 0))
    cluster = with_rates(load_cluster(CLUSTERS / run["cluster"]), rates).model_copy(update={"nodes": run["nodes"]})
    found = search(cluster, w, 3, strategies=(run["layout"]["strategy"],),
                   offload=run["layout"].get("offload", False))
    settings = run.get("settings", {})
    engine = run["layout"]["engine"]  # (the source's: the planner may find the other faster)
    tp = run["layout"].get("tensor_parallel")
    fit, rejected = ([c for c in plans if c.setting.generation_engine == engine and tp_of(c.setting, tp)]
                     for plans in (found.fit, found.rejected))
    pool = fit or (rejected if settings else [])
    if not pool:
        return None, found
    best = pool[0]
    # (a generator of its own was searched at each TP size, its groups formed for it: the plan is the
    # fastest of that size; where the actor's group generates, the groups are the same at any TP size,
    # which the planner leaves at 1, and the source's is set)
    own = any(g.own_engine for g in best.setting.groups)
    layout = dataclasses.replace(best.setting, micro_batch=settings.get("micro_batch", best.setting.micro_batch),
                                 tensor_parallel=best.setting.tensor_parallel if own or tp is None else tp)
    # (as the search sized them: the generate() batch or KV cache that fits, unless the source states it)
    w = dataclasses.replace(w, generate_batch=settings.get("generate_batch"), kv_cache_gb=None)
    return dataclasses.replace(best, setting=layout, estimate=estimate(layout, w, cluster)), found


def tp_of(s, tp: int | None) -> bool:
    """Whether plan setting `s` generates at the source's TP size `tp` (None: any), where a generator of its
    own is searched at each size."""
    return tp is None or s.tensor_parallel == tp or not any(g.own_engine for g in s.groups)


def with_rates(cluster, rates: dict | None):
    """`cluster` with {"section.field": value} in place of its own (validated as the cluster file is)."""
    for key, value in (rates or {}).items():
        section, field = key.split(".")
        part = getattr(cluster, section)
        cluster = cluster.model_copy(update={section: part.model_validate({**part.model_dump(), field: value})})
    return cluster


def short(reason: str) -> str:
    """The GB a plan lacks, from the estimate's reason ("... (12.3 GB short) ...")."""
    found = re.search(r"([\d.]+) GB short", reason)
    return found.group(1) if found else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(REPO / "tests" / "fixtures" / "published_runs.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a rate in place of every cluster file's, e.g. overheads.decode_step_hf=0.025")
    args = parser.parse_args()

    from pydantic import ValidationError

    from toolkit.placement.cluster import load_cluster
    from toolkit.table import text_table

    rates = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        section, dot, field = key.partition(".")
        if not (eq and dot and section in ("device", "links", "overheads") and field):
            parser.error(f"--set {item}: give SECTION.FIELD=VALUE, SECTION one of device, links, overheads")
        try:
            rates[key] = float(value)
            with_rates(load_cluster(CLUSTERS / "1x8-a100-80g.yaml"), {key: rates[key]})
        except ValidationError as e:
            parser.error(f"--set {item}: {e.errors()[0]['msg']}")
        except ValueError:
            parser.error(f"--set {item}: {value!r} is not a number")

    runs = yaml.safe_load(Path(args.runs).read_text())
    rows = [("run", "published s", "predicted s", "error", "generate", "score", "train", "sync", "published phases",
             "plan")]
    errors, predicted = [], {}
    for run in runs:
        best, found = predict(run, rates)
        if best is None:
            rows.append((run["id"], f"{run['step_s']:.1f}", "no fit", "", "", "", "", "", "",
                         "; ".join(found.rejected[0].estimate.short)[:80] if found.rejected else ""))
            errors.append(float("inf"))
            continue
        e, s = best.estimate, best.setting
        predicted[run["id"]] = e.step_s
        error = e.step_s / run["step_s"] - 1
        errors.append(abs(error))
        published = run.get("phases", {})
        rows.append((run["id"] + (" *" if run.get("calibrates") else ""), f"{run['step_s']:.1f}", f"{e.step_s:.1f}",
                     f"{error:+.0%}",
                     *(f"{e.phases[k]:.1f}" for k in ("generate", "score", "train", "sync")),
                     f"gen+score {published['generate']:.0f}, train {published['train']:.0f}" if published else "",
                     f"{s.describe()} TP{s.tensor_parallel} ZeRO-{s.zero_stage} mb {s.micro_batch}"
                     + (f" gen batch {e.generate_batch}" if "generate_batch" in run.get("settings", {}) else "")
                     + (f" lag {run['layout']['max_policy_lag']}" if run["layout"].get("max_policy_lag") else "")
                     + ("" if e.fits else f" (over our memory model by {short(e.short[0])} GB)")))
    print(text_table(rows))
    print("(* sets a rate of the cluster files: " + ", ".join(f"{r['id']}: {r['calibrates']}" for r in runs
                                                             if r.get("calibrates")) + ")")
    pairs = [(a, b) for i, a in enumerate(runs) for b in runs[i + 1:] if a["id"].split("-")[:2] == b["id"].split("-")[:2]
             and a["cluster"] == b["cluster"] and a["nodes"] == b["nodes"] and a["workload"]["prompts"] ==
             b["workload"]["prompts"] and a["layout"] != b["layout"] and a["id"] in predicted and b["id"] in predicted]
    for a, b in pairs:
        faster = min((a, b), key=lambda r: r["step_s"])["id"]
        ranked = min((a, b), key=lambda r: predicted[r["id"]])["id"]
        print(f"pair {a['id']} / {b['id']}: published faster {faster}; predicted faster {ranked} "
              f"({'right' if faster == ranked else 'wrong'})")
    checks = [e for run, e in zip(runs, errors) if not run.get("calibrates")]
    print(f"within 25%: {sum(e <= 0.25 for e in checks)} of {len(checks)} (not counting "
          f"{len(runs) - len(checks)} run(s) that set a rate of the cluster files); largest error {max(checks):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
