"""An end-to-end GRPO step against TRL's GRPOTrainer: the same model, workload and reward, side by side.

    python tools/bench_trl.py [--steps 5] [--variable]

The model: a random 26M-parameter Llama (hidden 512, 8 layers, 8 heads, intermediate 1376) with the tiny
tokenizer's 512 vocab, fp32. The workload: 16 prompts x 4 samples x 128 new tokens per step, every
response forced to full length on both sides (slurm-rlhf: `rollout.ignore_eos`; TRL: `min_new_tokens`),
KL coefficient 0.04 against a reference model, reward `digit_ratio`, one optimizer step per 64 samples in
micro-batches of 16. slurm-rlhf runs four times: Separation (vLLM generator, scorer and trainer in
processes of their own), Flattening (every role in one process, what a one-GPU user runs; vLLM generates
in the trainer's process, `rollout.backend: vllm`), Flattening with `rollout.backend: hf` (the actor
itself generates, with transformers `generate`: what vLLM gives there; not in the ratio), and Flattening
whose OpenMP threads spin 3000 times before they sleep (`run.openmp_spin`; off by default, as it slows a
worker beside other busy processes; TRL's threads spin up to 300,000 times, GNU OpenMP's default; not in
the ratio). TRL goes into a virtual environment of its own, `.venv-trl` (made on first use, with the same
torch and transformers), and runs tools/trl_grpo.py.

Both sides train with the same memory switches: none. TRL 1.16's GRPOConfig turns activation (gradient)
checkpointing on by default, which recomputes each micro-batch's forward pass (a third more training
FLOPs) to hold fewer activations; so TRL runs with it off, as we train, for the ratio, and once more with
its defaults, as a user who changes nothing gets it.

Figures: the median step time over the steps after the first (slurm-rlhf: also the last, which
exports), each phase's median (TRL's, timed around its methods by tools/trl_grpo.py: its generation;
scoring, the rest of `_generate_and_score_completions`: reference log-probs, rewards, advantages; and
training, the rest of the step), and the peak of the summed resident memory of
every process of the run, as RSS and as PSS (which counts a page shared by several processes once); see
`PeakMemory` for how it is sampled without slowing the run. The last line is `ratio R`: the lower of TRL's
median step time over ours, for Separation and Flattening, TRL with the same switches. Our workers run
with what they preload by default: the allocator that `run.allocator: auto` picks (tcmalloc where
installed) and, on an AMD CPU, MKL's library (`run.fast_mkl_on_amd`: MKL's Intel kernels, about twice as
fast in training and scoring there). TRL runs as its users run it, and once more with the same libraries
preloaded: the line above the ratio gives our speed against that TRL too.

`--variable`: samples of very different lengths, as real RL has them. The model's end-of-sequence token
then has the same probability at every position (1/64), so response lengths are geometric (mean about
64) and cut at 256 new tokens; nothing is forced. slurm-rlhf fills training micro-batches by token budget
(`trainer.micro_batch_tokens`, 16 x the longest possible sample: the same largest micro-batch as rows
of 16), scores samples grouped by length (the default), and packs each micro-batch and scoring pass into
one sequence (`model.packing`); it runs synchronously, and asynchronously (Separation,
`rollout.max_policy_lag: 1`, one thread per worker, as `tools/bench_async.py` found best on these
cores), and once more synchronously without packing (padded to each micro-batch's longest sample), to
show what packing gives. TRL pads, as its users run it. Its last line is `ratio R` for packing and
async: TRL's step time over Separation's, asynchronous.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TRL_VENV = REPO / ".venv-trl"
TRL = "trl==1.16.0"


SPIN = 3000  # run.openmp_spin of the last row (tools/bench_openmp.py --spin: the best count on these 2 cores)
EOS_RATE, VARIABLE_MAX = 1 / 64, 256  # --variable: the end-of-sequence token's probability per position, the cut


def build_model(tiny: Path, out: Path, eos_rate: float | None = None) -> None:
    """The benchmark's Llama with the tiny tokenizer. With `eos_rate`, end-of-sequence has that probability
    at every position (`toolkit.tiny.set_eos_rate`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.tiny import copy_tokenizer, set_eos_rate

    torch.manual_seed(0)
    small = json.loads((tiny / "model" / "config.json").read_text())
    config = LlamaConfig(vocab_size=small["vocab_size"], hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=8, intermediate_size=1376, max_position_embeddings=512,
                         bos_token_id=small["bos_token_id"], eos_token_id=small["eos_token_id"],
                         pad_token_id=small["pad_token_id"], tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if eos_rate:
        set_eos_rate(model, eos_rate)
    model.save_pretrained(out)
    copy_tokenizer(tiny / "model", out)


def trl_python() -> Path:
    """TRL's virtual environment (made once): the same torch and transformers as ours."""
    python = TRL_VENV / "bin" / "python"
    if not (TRL_VENV / ".installed").exists():
        print(f"bench_trl: installing {TRL} into {TRL_VENV} (once)", flush=True)
        subprocess.run([os.environ.get("PYTHON", "python3"), "-m", "venv", str(TRL_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "-c", str(REPO / "tools" / "constraints-cpu.txt")]
        with open(TRL_VENV / "setup.log", "w") as log:  # (shown only if pip fails)
            for packages in (["torch"], [TRL, "transformers", "datasets", "accelerate"]):
                if subprocess.run([*pip, *packages], stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                    raise SystemExit(f"bench_trl: pip install {' '.join(packages)} failed; see {TRL_VENV / 'setup.log'}")
        (TRL_VENV / ".installed").write_text(TRL)
    return python


class PeakMemory(threading.Thread):
    """The peaks of the summed resident (RSS) and proportional (PSS) memory of a process and all its
    descendants. RSS counts a page shared by several processes (torch's libraries, the model files mapped
    by each) once per process; PSS splits it among them, so its sum is what the processes take from the
    machine.

    Sampling must not slow what it measures. RSS is read 4 times a second from /proc/PID/statm (a
    counter). PSS needs the kernel to walk every page of a process (/proc/PID/smaps_rollup): done 4 times
    a second over our 4 processes, as this class first did with psutil, it took 25-55% of a core, and our
    Separation steps took 25.3-29.1 s sampled against 18.6 s unsampled (runs of the same afternoon); it
    slowed TRL's one process less. So PSS is read only when the summed RSS is within 3% of its peak so far,
    at most every 2 s."""

    NEAR_PEAK, PSS_EVERY_S = 0.97, 2.0

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.peak_pss, self.done = pid, 0, 0, threading.Event()

    def run(self) -> None:
        import time

        import psutil

        page = os.sysconf("SC_PAGE_SIZE")
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        last_pss = -self.PSS_EVERY_S
        while not self.done.wait(0.25):
            try:
                pids = [root.pid, *(c.pid for c in root.children(recursive=True))]
            except psutil.NoSuchProcess:
                return
            total = sum(_rss(pid, page) for pid in pids)
            self.peak = max(self.peak, total)
            now = time.monotonic()
            if total >= self.NEAR_PEAK * self.peak and now - last_pss >= self.PSS_EVERY_S:
                last_pss = now
                self.peak_pss = max(self.peak_pss, sum(_pss(pid) for pid in pids))


def _proc_file(pid: int, name: str) -> str:
    """/proc/PID/NAME's text; empty for a process that has ended."""
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def _rss(pid: int, page: int) -> int:
    """Resident bytes of a process (statm's second field, in pages); 0 once it has ended."""
    fields = _proc_file(pid, "statm").split()
    return int(fields[1]) * page if len(fields) > 1 else 0


def _pss(pid: int) -> int:
    """Proportional bytes of a process (smaps_rollup's Pss line, in kB); 0 once it has ended."""
    for line in _proc_file(pid, "smaps_rollup").splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def measured(command: list[str], **kwargs) -> PeakMemory:
    """Run `command` to completion; the peak memory of its processes (bytes: `peak` RSS, `peak_pss`)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    peak = PeakMemory(process.pid)
    peak.start()
    try:
        output, _ = process.communicate()
    except BaseException:  # (Ctrl-C, SIGTERM: the run ends with this tool, not after it)
        process.kill()
        process.wait()
        raise
    finally:
        peak.done.set()
        peak.join()
    if process.returncode != 0:
        raise SystemExit(f"bench_trl: {' '.join(command[:4])} ... failed:\n{output[-4000:]}")
    return peak


def ours(model: Path, prompts: Path, tmp: Path, strategy: str, steps: int, variable: bool = False,
         lag: int = 0, rollout: dict | None = None, placement: dict | None = None, name: str = "",
         packing: bool = False, run: dict | None = None) -> dict:
    """Our run of the workload (`rollout`, `placement`, `run`: settings on top; `name`: of its run directory;
    `packing`: `model.packing`, on samples of variable length only)."""
    config = {"run": {"name": f"bench-{strategy}", "algorithm": "grpo", "steps": steps + 2, "seed": 0},
              "data": {"prompts": str(prompts)}, "model": {"actor": str(model)},
              "rollout": {"prompts_per_step": 16, "group_size": 4, "max_new_tokens": 128, "ignore_eos": True,
                          "backend": "vllm"},  # (Flattening: vLLM in the trainer's process)
              "reward": {"functions": [{"function": "toolkit.rewards.examples:digit_ratio"}]},
              "algorithm": {"kl": {"coef": 0.04}},
              "trainer": {"zero_stage": 2, "lr": 1e-5, "micro_batch_size": 16},
              "placement": {"strategy": strategy}, "checkpoint": {"every_steps": 10**6}}
    if variable:
        config["rollout"].update(max_new_tokens=VARIABLE_MAX, ignore_eos=False, max_policy_lag=lag,
                                 max_prompt_tokens=32)  # (the tiny prompts have at most 14)
        config["trainer"]["micro_batch_tokens"] = 16 * (32 + VARIABLE_MAX)
        config["model"]["packing"] = packing
        if lag:
            config["placement"].update({group: {"cpus_per_worker": 1} for group in ("generator", "scorer", "trainer")})
    config["rollout"].update(rollout or {})
    config["placement"].update(placement or {})
    config["run"].update(run or {})
    path = tmp / f"{strategy}-{lag}{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp / f"run-{strategy}-{lag}{name}"
    peak = measured([sys.executable, "-m", "toolkit", "run", str(path), "--run-dir", str(run_dir)], cwd=REPO)
    steady = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:-1]
    phases = {k: statistics.median(m[k] for m in steady) for k in ("generate_s", "score_s", "train_s", "sync_s")}
    return {"step_s": statistics.median(m["step_s"] for m in steady), **phases, "peak": peak.peak, "pss": peak.peak_pss,
            "response_len": statistics.mean(m["response_len_mean"] for m in steady),
            "reward_mean": statistics.mean(m["reward_mean"] for m in steady)}


def theirs(model: Path, prompts: Path, tmp: Path, steps: int, preload: list[str] | None = None,
           variable: bool = False, checkpointing: bool = False) -> dict:
    """TRL as its users run it; with `preload`, with those libraries in LD_PRELOAD (what our workers
    preload); with `checkpointing`, with activation checkpointing (its GRPOConfig's default)."""
    out = tmp / "trl.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if preload:
        env["LD_PRELOAD"] = " ".join(preload)
    peak = measured([str(trl_python()), str(REPO / "tools" / "trl_grpo.py"), str(model), str(prompts),
                     str(steps + 1), str(out), *(["--free", str(VARIABLE_MAX)] if variable else []),
                     *(["--checkpointing"] if checkpointing else [])], env=env)
    result = json.loads(out.read_text())
    steps = list(zip(result["step_s"], result["generate_s"], result["score_s"]))[1:]
    # (TRL generates once per optimizer step; what is neither generation nor scoring is training)
    phases = {"generate_s": statistics.median(g for _, g, _ in steps), "score_s": statistics.median(c for _, _, c in steps),
              "train_s": statistics.median(s - g - c for s, g, c in steps), "sync_s": None}
    return {"step_s": statistics.median(result["step_s"][1:]), **phases, "peak": peak.peak, "pss": peak.peak_pss,
            "version": result["trl"], "response_len": statistics.mean(result["response_len"][1:] or [float("nan")])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="measured steps of each system (after a first one)")
    parser.add_argument("--variable", action="store_true",
                        help="responses of geometric length (mean about 64, cut at 256), packing and async")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: 1 or more (each system's first step, start-up, is not measured)")
    from toolkit.launch import mkl_amd
    from toolkit.launch.allocator import choice
    from toolkit.table import text_table
    from toolkit.tiny import build_tiny

    # (key, strategy, max_policy_lag, model.packing, rollout.backend, the row's name)
    runs = [("separation", "separation", 0, False, "vllm", "separation"),
            ("flattening", "flattening", 0, False, "vllm", "flattening"),
            ("flattening-hf", "flattening", 0, False, "hf", "flattening, transformers generate"),
            ("flattening-spin", "flattening", 0, False, "vllm", f"flattening, run.openmp_spin {SPIN}")]
    if args.variable:
        runs = [("separation", "separation", 0, True, "vllm", "separation, packed"),
                ("async", "separation", 1, True, "vllm", "separation, packed, async lag 1"),
                ("flattening", "flattening", 0, True, "vllm", "flattening, packed"),
                ("padded", "separation", 0, False, "vllm", "separation, padded")]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        tiny = build_tiny(tmp / "tiny")
        model = tmp / "model"
        build_model(tiny, model, EOS_RATE if args.variable else None)
        prompts = tiny / "prompts.jsonl"
        results = {"TRL": theirs(model, prompts, tmp, args.steps, variable=args.variable),
                   "TRL defaults": theirs(model, prompts, tmp, args.steps, variable=args.variable, checkpointing=True)}
        allocator, library = choice("auto")  # (what run.allocator auto gives our workers)
        mkl, _ = mkl_amd.library()  # (and run.fast_mkl_on_amd, on an AMD CPU)
        preloads = [lib for lib in (library, mkl) if lib]
        ours_with = " + ".join([allocator, *(["MKL on AMD"] if mkl else [])])
        if preloads:
            results["TRL+"] = theirs(model, prompts, tmp, args.steps, preloads, variable=args.variable)
        for key, strategy, lag, packing, backend, _ in runs:
            results[key] = ours(model, prompts, tmp, strategy, args.steps, args.variable, lag, name=f"-{key}",
                                packing=packing, rollout={"backend": backend},
                                run={"openmp_spin": SPIN} if key.endswith("-spin") else None)

    trl = results["TRL"]
    rows = [("system", "step s (median)", "mean response", "generate s", "score s", "train s", "sync s",
             "peak RSS GB", "peak PSS GB", "PSS / TRL's", "TRL / this")]
    labels = [("TRL", f"TRL {trl['version']} GRPOTrainer, no act. checkpointing"),
              ("TRL+", f"TRL, {ours_with} preloaded"), ("TRL defaults", "TRL, activation checkpointing (its default)")]
    labels += [(key, f"slurm-rlhf {label}, {ours_with}") for key, *_, label in runs]
    for key, label in labels:
        if key in results:
            r = results[key]
            rows.append((label, f"{r['step_s']:.2f}", f"{r['response_len']:.0f}",
                         *("" if r[k] is None else f"{r[k]:.2f}" for k in ("generate_s", "score_s", "train_s", "sync_s")),
                         f"{r['peak'] / 1e9:.2f}", f"{r['pss'] / 1e9:.2f}", f"{r['pss'] / trl['pss']:.2f}",
                         f"{trl['step_s'] / r['step_s']:.2f}"))
    if args.variable:
        print(f"GRPO step: 26M-parameter Llama, 16 prompts x 4 samples, responses of geometric length (end of "
              f"sequence at 1/{round(1 / EOS_RATE)} a token, cut at {VARIABLE_MAX}), KL 0.04, fp32, "
              f"{args.steps} steps measured, {os.cpu_count()} cores")
    else:
        print(f"GRPO step: 26M-parameter Llama, 16 prompts x 4 samples x 128 new tokens, KL 0.04, fp32, "
              f"{args.steps} steps measured, {os.cpu_count()} cores")
    print(text_table(rows))
    measured_keys = ["async"] if args.variable else ["separation", "flattening"]
    against = {key: min(results[key]["step_s"] / results[k]["step_s"] for k in measured_keys)
               for key in ("TRL+", "TRL defaults") if key in results}
    notes = [f"against TRL with its default activation checkpointing: {against['TRL defaults']:.2f}"]
    if "TRL+" in against:
        notes.append(f"our workers ran with what run.allocator auto and run.fast_mkl_on_amd give, as named; against "
                     f"TRL with the same preloaded ({ours_with}): {against['TRL+']:.2f}")
        if "flattening-spin" in results:
            notes.append(f"Flattening with run.openmp_spin {SPIN} against that TRL: "
                         f"{results['TRL+']['step_s'] / results['flattening-spin']['step_s']:.2f}")
    print(f"({'; '.join(notes)})")
    print(f"ratio {min(trl['step_s'] / results[k]['step_s'] for k in measured_keys):.2f}")
    return 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
