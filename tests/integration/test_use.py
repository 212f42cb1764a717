"""Using a trained model: `export` (a verified copy of a checkpoint, its EMA, refusals that name what is
wrong), `generate` (vLLM and transformers agree on greedy samples; seeds; input errors by line), `eval`
(checkpoints scored on held-out prompts) and `chat`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO, cli, example, left_in, short_tmpdir, start_held, write_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory) -> Path:
    """A 4-step GRPO run with an EMA, a checkpoint after every step, the newest 3 kept (steps 2, 3, 4)."""
    tmp = tmp_path_factory.mktemp("use")
    config = write_config(tmp, example("tiny-grpo.yaml", tiny, run={"steps": 4, "name": "use", "seed": 4},
                                       trainer={"lr": 0.01, "ema": 0.5}, checkpoint={"every_steps": 1, "keep": 3}))
    result = cli("run", config, "--run-dir", tmp / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp / "run"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"id": "a", "prompt": "1 2 3"}, {"id": "b", "prompt": [{"role": "user", "content": "count to 9"}]},
            {"id": "c", "prompt": "hello", "extra": [1, 2]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir() if p.name != "slurm_rlhf.json")
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_export_copies_the_newest_checkpoint_or_a_chosen_one(trained, tmp_path):
    result = cli("export", trained, tmp_path / "newest")
    assert result.returncode == 0, result.stderr
    same_files(trained / "checkpoints" / "step-000004" / "hf", tmp_path / "newest")
    same_files(trained / "export", tmp_path / "newest")  # the run's own final export is the same model
    origin = json.loads((tmp_path / "newest" / "slurm_rlhf.json").read_text())
    assert origin == {"run_dir": str(trained.resolve()), "step": 4, "ema": False, "lora_merged": False}
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "newest").rglob("*") if p.is_file()}
    assert set(modes.values()) == {"0o600"}, modes  # (slurm_rlhf.json was 0o644 beside weights of 0o600)

    assert cli("export", trained, tmp_path / "ema", "--step", 3, "--ema").returncode == 0
    same_files(trained / "checkpoints" / "step-000003" / "hf-ema", tmp_path / "ema")
    a, b = load_file(tmp_path / "ema" / "model.safetensors"), load_file(tmp_path / "newest" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-4
    assert not list(tmp_path.glob(".*"))  # no temporary directory left behind


@pytest.mark.parametrize("args, message", [
    (["--step", 1], "no checkpoint at step 1; it has steps 2, 3, 4"),
    (["--step", 7], "no checkpoint at step 7"),
])
def test_export_names_a_missing_checkpoint(trained, tmp_path, args, message):
    result = cli("export", trained, tmp_path / "out", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_damaged_copy_and_a_used_target(trained, prompts, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    weights = copy / "checkpoints" / "step-000004" / "hf" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    result = cli("export", copy, tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert f"{weights}: checksum mismatch" in result.stderr and "--step" in result.stderr
    assert not (tmp_path / "out").exists()
    result = cli("eval", copy, "--input", prompts)  # (eval's option is --steps: it said --step)
    assert result.returncode == 2 and f"{weights}: checksum mismatch" in result.stderr, result.stderr
    assert "; choose another checkpoint with --steps (this run has 2, 3, 4)" in result.stderr, result.stderr
    assert cli("export", copy, tmp_path / "out", "--step", 3).returncode == 0  # an older one is whole

    result = cli("export", trained, tmp_path / "out")
    assert result.returncode == 2 and "is not empty; give a new or empty directory for the export" in result.stderr
    result = cli("export", trained / "export", tmp_path / "x")
    assert result.returncode == 2 and "is a model directory already" in result.stderr


def test_export_of_a_checkpoint_the_run_removes_while_it_is_copied_names_the_steps_it_has(trained, tmp_path,
                                                                                          monkeypatch):
    """A live run removes its older checkpoints (checkpoint.keep) after each new one: the run's own removal
    (store/checkpoint.py) is made to happen once the export has copied its first file (the moment cannot be
    held otherwise). It ended in shutil's traceback listing every file; now an error names the steps left."""
    from toolkit.errors import ConfigError
    from toolkit.store import checkpoint
    from toolkit.store.manifest import Manifest
    from toolkit.use.export import export

    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    real = shutil.copyfile

    def copyfile(src, dst, **kwargs):
        out = real(src, dst, **kwargs)
        if (copy / "checkpoints" / "step-000002").exists():
            checkpoint._remove_old(copy, Manifest(copy), 2, 4)  # (the run, keep 2, after saving step 4)
        return out

    monkeypatch.setattr(shutil, "copyfile", copyfile)
    with pytest.raises(ConfigError, match=r"checkpoint step 2 was removed while it was copied .*it has now \(3, 4\)"):
        export(str(copy), str(tmp_path / "out"), 2)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_export_removes_what_a_killed_export_left_beside_it_and_not_a_build_going_on(trained, tmp_path):
    """An export killed mid-copy (SIGKILL, the OOM killer, a lost node) left its hidden .OUT.building-PID, as
    big as the model; the next export to OUT left it there too, and nothing ever removed it. One that a live
    process builds in (it holds a flock on it) is not touched."""
    from toolkit.flock import flock_held
    from toolkit.use.export import export

    killed = tmp_path / ".out.building-999999"
    (killed / "partial").mkdir(parents=True)
    (killed / "partial" / "model.safetensors").write_bytes(b"\0" * 4096)
    going = tmp_path / ".out.building-999998"
    going.mkdir()
    with flock_held(going, 1, lambda: AssertionError("lock not free")):
        export(str(trained), str(tmp_path / "out"))
    same_files(trained / "checkpoints" / "step-000004" / "hf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [going.name, "out"]


def test_export_is_on_disk_before_it_is_named(trained, tmp_path, monkeypatch):
    """`export` renamed its copy into place with no fsync at all (strace: 0 calls), so after a node crash OUT
    could be there with empty files, where the run's own export/ is settled first. A power loss cannot be
    staged here: os.fsync is watched (and called through) to see what reached the disk before the rename."""
    from toolkit.use.export import export

    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    export(str(trained), str(tmp_path / "out"))
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    building = [Path(p) for p in synced if ".out.building-" in p]
    assert sorted(p.name for p in building if p.name in files) == files  # every file, under its temporary name
    assert synced[-1] == str(tmp_path)  # and then the rename


def test_generate_from_a_checkpoint_the_run_removes_before_it_loads_names_the_steps_it_has(trained, prompts, tmp_path,
                                                                                          monkeypatch):
    """A live run removes its older checkpoints (checkpoint.keep); one removed after `generate` chose it and
    before its engine loaded it (vLLM's start takes 20-60 s) was said to hold no tokenizer, with the advice
    to save one there. The run's own removal (store/checkpoint.py) is made to happen at that moment."""
    from toolkit.errors import ConfigError
    from toolkit.store import checkpoint
    from toolkit.store.manifest import Manifest
    from toolkit.use import generate as generating
    from toolkit.use.sampler import Sampling
    from toolkit.use.source import resolve

    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    source = resolve(str(copy), 2)
    read = generating.read_prompts

    def read_prompts(*args, **kwargs):
        found = read(*args, **kwargs)
        checkpoint._remove_old(copy, Manifest(copy), 2, 4)  # (the run, keep 2, after saving step 4)
        return found

    monkeypatch.setattr(generating, "read_prompts", read_prompts)
    with pytest.raises(ConfigError, match=r"checkpoint step 2 was removed by the run before it was read .*it has "
                                          r"now \(3, 4\)"):
        generating.generate(source.path, str(prompts), str(tmp_path / "out.jsonl"), Sampling(4), "hf",
                            removed=source.removed)
    assert not (tmp_path / "out.jsonl").exists()


def samples(result) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.fixture(scope="module")
def greedy(trained, prompts) -> dict[str, list[dict]]:
    """Greedy samples of the run's newest checkpoint from each engine, as `generate` writes them to
    standard output."""
    common = ["generate", trained, "--input", prompts, "--temperature", 0, "--max-new-tokens", 12]
    return {backend: samples(cli(*common, "--backend", backend)) for backend in ("vllm", "hf")}


def test_generate_greedy_agrees_between_vllm_and_transformers(greedy):
    """Greedy samples of the run's newest checkpoint: the same tokens and log-probs from either engine.
    The samples go to standard output, which stays clean JSON Lines (vLLM's logs go to stderr)."""
    vllm, hf = greedy["vllm"], greedy["hf"]
    assert [s["id"] for s in vllm] == ["a", "b", "c"] and vllm[2]["extra"] == [1, 2]
    assert [s["response"] for s in vllm] == [s["response"] for s in hf]
    for v, h in zip(vllm, hf):
        assert v["response_tokens"] == h["response_tokens"] and abs(v["logprob"] - h["logprob"]) < 1e-3


def test_generate_seeds_each_sample(trained, prompts, tmp_path):
    out = tmp_path / "out.jsonl"
    common = ["generate", trained, "--input", prompts, "--n", 3, "--max-new-tokens", 12, "--output", out]
    assert cli(*common).returncode == 0
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(s["id"], s["sample"]) for s in first] == [(i, k) for i in "abc" for k in range(3)]
    assert len({s["response"] for s in first}) == 9  # no two samples share a random stream
    # The same seed gives the same samples again, and each row's samples depend on its place in the file,
    # not on the rows beside it: the first two rows alone (another batch) get the first two rows' samples.
    two = tmp_path / "two.jsonl"
    two.write_text("".join(prompts.read_text().splitlines(keepends=True)[:2]))
    refused = cli("generate", trained, "--input", two, "--n", 3, "--max-new-tokens", 12, "--output", out)
    assert refused.returncode == 2 and f"--output {out} exists; choose another name, or --force" in refused.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == first  # (untouched)
    assert cli("generate", trained, "--input", two, "--n", 3, "--max-new-tokens", 12, "--output", out,
               "--force").returncode == 0
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(s["id"], s["sample"], s["response"]) for s in again] == [(s["id"], s["sample"], s["response"])
                                                                       for s in first[:6]]


@pytest.mark.parametrize("length, message", [
    (8, "--max-model-len 8: the context must hold a prompt and --max-new-tokens 8"),
    (100000, "a context of 100000 tokens (--max-model-len, else the longest prompt and --max-new-tokens) is more "
             "than the model takes: 512 (max_position_embeddings 512 in"),
])
def test_generate_names_a_context_that_does_not_fit(tiny, prompts, tmp_path, length, message):
    result = cli("generate", tiny / "model", "--input", prompts, "--output", tmp_path / "out.jsonl", "--backend",
                 "hf", "--max-new-tokens", 8, "--max-model-len", length)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())


def test_generate_refuses_an_output_that_is_a_directory(tiny, prompts, tmp_path):
    """`--output DIR --force` sampled every prompt, then ended in IsADirectoryError's traceback."""
    target = tmp_path / "samples"
    target.mkdir()
    result = cli("generate", tiny / "model", "--input", prompts, "--output", target, "--force", "--backend", "hf",
                 "--max-new-tokens", 4)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (f"--output {target} is a directory; give the file to write, e.g. {target / 'samples.jsonl'}"
            in result.stderr), result.stderr
    assert not list(tmp_path.rglob("*.tmp-*")) and not list(target.iterdir())


def test_generate_writes_samples_for_their_owner_alone(tiny, prompts, tmp_path):
    """Under the usual umask 022 the samples file was readable by every user (mode 644), where a run's files,
    its report and eval's results are the owner's alone: it is written so (600) in a folder everyone can read."""
    public = tmp_path / "public"
    public.mkdir(mode=0o755)
    umask = os.umask(0o022)
    try:
        result = cli("generate", tiny / "model", "--input", prompts, "--output", public / "out.jsonl",
                     "--backend", "hf", "--max-new-tokens", 4)
    finally:
        os.umask(umask)
    assert result.returncode == 0, result.stderr
    assert len((public / "out.jsonl").read_text().splitlines()) == 3
    assert {p.name: p.stat().st_mode & 0o777 for p in public.iterdir()} == {"out.jsonl": 0o600}


def test_generate_reads_alpaca_rows_by_their_keys(tiny, tmp_path):
    """A .json array of Alpaca rows: --prompt-key names the instruction, --input-key joins the input after a blank
    line (as data.input_key does in training); greedy, the same samples as the joined text given as "prompt"."""
    rows = [{"instruction": "Count on.", "input": "1 2 3", "output": "4"},
            {"instruction": "Say hello.", "input": "", "output": "hello"}]
    alpaca, joined = tmp_path / "alpaca.json", tmp_path / "joined.jsonl"
    alpaca.write_text(json.dumps(rows, indent=2))
    joined.write_text(json.dumps({"prompt": "Count on.\n\n1 2 3"}) + "\n" + json.dumps({"prompt": "Say hello."}) + "\n")
    common = ["generate", tiny / "model", "--backend", "hf", "--temperature", 0, "--max-new-tokens", 8]
    refused = cli(*common, "--input", alpaca)
    assert refused.returncode == 2 and (f'{alpaca}: item 1: expected "prompt": a string or a list of {{"role", '
                                        '"content"} messages, got no such field (fields: [\'input\', \'instruction\', '
                                        "'output']); --prompt-key names the prompt's field") in refused.stderr
    by_keys = samples(cli(*common, "--input", alpaca, "--prompt-key", "instruction", "--input-key", "input"))
    assert [s["output"] for s in by_keys] == ["4", "hello"]  # (the rows' own fields are kept)
    same = samples(cli(*common, "--input", joined))
    assert [(s["response"], round(s["logprob"], 4)) for s in by_keys] == [(s["response"], round(s["logprob"], 4))
                                                                         for s in same]
    alone = samples(cli(*common, "--input", alpaca, "--prompt-key", "instruction"))  # (the input does count)
    assert abs(alone[0]["logprob"] - by_keys[0]["logprob"]) > 1e-3  # (row 2: the same sample, up to the rounding
    assert abs(alone[1].pop("logprob") - by_keys[1].pop("logprob")) < 1e-4 and alone[1] == by_keys[1]  # of padding)


@pytest.mark.parametrize("line, message", [
    ('{"id": 1}', 'bad.jsonl:2: expected "prompt": a string or a list of {"role", "content"} messages'),
    ('{"prompt": [{"role": "user"}]}', "bad.jsonl:2: expected \"prompt\""),
    ('{"prompt": "x"', "bad.jsonl:2: not valid JSON"),
    # (no tokens at all: the engine failed inside transformers, after the model loaded, naming no line)
    ('{"prompt": ""}', 'bad.jsonl:2: the prompt "" is no tokens (this tokenizer adds no begin-of-sequence token)'),
    # (an SFT row's reference response was replaced by the sample without a word)
    ('{"prompt": "x", "response": "mine"}',
     'bad.jsonl:2: field "response" is one that generate writes (each output line is the row\'s fields and sample, '
     'response, response_tokens, finished, logprob), so its value would be replaced; rename it in the input'),
])
def test_generate_names_the_bad_line(trained, tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n' + line + "\n")
    result = cli("generate", trained, "--input", bad, "--output", tmp_path / "out.jsonl", "--backend", "hf")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not list(tmp_path.glob("*out.jsonl*"))  # nothing half written


@pytest.fixture(scope="module")
def held_out(tiny, tmp_path_factory) -> Path:
    """A 3-step GRPO run that holds a tenth of its prompts out (data.eval_fraction), a checkpoint after every
    step (steps 1, 2, 3)."""
    tmp = tmp_path_factory.mktemp("held-out")
    config = write_config(tmp, example("tiny-grpo.yaml", tiny, run={"steps": 3, "name": "held-out", "seed": 4},
                                       trainer={"lr": 0.01}, checkpoint={"every_steps": 1, "keep": 3},
                                       data={"eval_fraction": 0.1}))
    result = cli("run", config, "--run-dir", tmp / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp / "run"


def test_eval_scores_checkpoints_on_the_held_out_prompts_with_the_runs_rewards(held_out, tmp_path):
    """`eval` samples each chosen checkpoint greedily on the prompts the run held out (none of which it
    trained on: read back from its experience files) and scores them with the run's reward function; each
    sample's reward is digit_ratio of its response, recomputed here, and the summary's means are theirs. A
    second call with --n 2 at temperature 1 goes under a name of its own (under the first's it is refused);
    TensorBoard gets each summary's curves in a run of their own. Prompts of a file (--input) are filed under
    file-<its name>."""
    from tests.conftest import tensorboard_scalars
    from toolkit.config import load_config
    from toolkit.data.dataset import StageData
    from toolkit.rewards.examples import digit_ratio
    from toolkit.store import experience

    cfg = load_config(held_out / "config.yaml")
    data = StageData(cfg.data, "rl", "prompt", cfg.run.seed)
    held = {e.id for e in data.eval}
    trained_on = {int(i) for path in (held_out / "experience").glob("step-*.h5")
                  for i in experience.read(path)["samples"]["prompt_ids"]}
    assert len(held) >= 10 and trained_on and not held & trained_on
    # ... nor any row of the same prompt (the tiny set has 90 prompts in 256 rows): held out by prompt
    text = {e.id: e.prompt for e in [*data.eval, *(e for part in data.train for e in part)]}
    assert not {text[i] for i in held} & {text[i] for i in trained_on}

    result = cli("eval", held_out, "--steps", "2,3")
    assert result.returncode == 0, result.stderr
    assert "memory allocator: tcmalloc" in result.stderr.splitlines()[0]  # (as the run's workers: run.allocator)
    out = held_out / "eval" / "heldout"
    summary = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    assert [r["step"] for r in summary] == [2, 3]
    for record in summary:
        assert record["n"] == 1 and record["temperature"] == 0 and record["prompts"] == len(held)
        rows = [json.loads(line) for line in (out / f"step-{record['step']:06d}.jsonl").read_text().splitlines()]
        assert {r["prompt_id"] for r in rows} == held and len(rows) == len(held)
        for r in rows:
            assert abs(r["reward"] - digit_ratio(r["prompt"], r["response"])) < 1e-6
            assert r["reward/digit_ratio"] == r["reward"] and 1 <= r["response_tokens"] <= cfg.rollout.max_new_tokens
        assert abs(record["reward_mean"] - sum(r["reward"] for r in rows) / len(rows)) < 1e-6
        assert f"step {record['step']:>6}  reward {record['reward_mean']:+.4f}" in result.stdout
    assert summary[0]["reward_mean"] != summary[1]["reward_mean"]  # (different weights, different samples)
    # One vLLM engine for both: step 3's weights loaded into it in place; they sample what an engine
    # started with them does.
    assert result.stdout.count("(sampling with vllm, started with the weights of step") == 1, result.stdout
    alone = cli("eval", held_out, "--steps", "3", "--name", "alone")
    assert alone.returncode == 0 and "started with the weights of step 3" in alone.stdout, alone.stderr
    fresh = [json.loads(line) for line in (held_out / "eval" / "alone" / "step-000003.jsonl").read_text().splitlines()]
    loaded = [json.loads(line) for line in (out / "step-000003.jsonl").read_text().splitlines()]
    assert [(r["prompt_id"], r["response"], r["response_tokens"]) for r in fresh] == \
        [(r["prompt_id"], r["response"], r["response_tokens"]) for r in loaded]
    for path in (out / "summary.jsonl", out / "step-000002.jsonl"):
        assert path.stat().st_mode & 0o777 == 0o600
    assert (out.stat().st_mode & 0o777, out.parent.stat().st_mode & 0o777) == (0o700, 0o700)

    again = cli("eval", held_out, "--steps", "3", "--n", "2", "--temperature", "1", "--name", "sampled")
    assert again.returncode == 0, again.stderr
    second = [json.loads(line) for line in (held_out / "eval" / "sampled" / "summary.jsonl").read_text().splitlines()]
    assert second[0]["n"] == 2 and second[0]["samples"] == 2 * len(held)
    assert second[0]["reward_best_of_n_mean"] >= second[0]["reward_mean"]
    assert [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()] == summary
    curves = tensorboard_scalars(held_out / "tensorboard" / "eval-heldout")
    assert curves["eval/reward_mean"] == pytest.approx({2: summary[0]["reward_mean"], 3: summary[1]["reward_mean"]})
    assert set(curves) >= {"eval/reward/digit_ratio", "eval/response_len_mean", "eval/finished_frac"}
    sampled = tensorboard_scalars(held_out / "tensorboard" / "eval-sampled")
    assert sampled["eval/reward_best_of_n_mean"] == pytest.approx({3: second[0]["reward_best_of_n_mean"]})
    assert not list(out.glob(".*"))  # (no temporary file left)

    given = tmp_path / "my.prompts.jsonl"  # (--input: rows read with the run's data keys, fields passed on)
    given.write_text('{"prompt": "Numbers and apples:", "topic": "apples"}\n{"prompt": "Count:", "topic": "x"}\n')
    third = cli("eval", held_out, "--steps", "3", "--input", given)
    assert third.returncode == 0, third.stderr
    written = held_out / "eval" / "file-my-prompts" / "step-000003.jsonl"
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert [(r["prompt_id"], r["prompt"]) for r in rows] == [(0, "Numbers and apples:"), (1, "Count:")]
    assert all(abs(r["reward"] - digit_ratio(r["prompt"], r["response"])) < 1e-6 for r in rows)

    report = cli("report", held_out, "--out", tmp_path / "report")  # (the report draws what eval wrote)
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report" / "index.html").read_text()
    assert (tmp_path / "report" / "evaluation.png").stat().st_size > 1000
    assert f"<td>heldout</td><td>2</td><td>{summary[0]['reward_mean']:.4f}</td>" in page
    assert f"<td>heldout</td><td>3</td><td>{summary[1]['reward_mean']:.4f}</td>" in page
    assert f"<td>sampled</td><td>3</td><td>{second[0]['reward_mean']:.4f}</td>" in page
    assert "<td>file-my-prompts</td><td>3</td>" in page


def test_eval_files_one_set_of_prompts_and_settings_under_a_name(held_out, tmp_path):
    """A name's summary is one curve (status, the report, TensorBoard): `eval --name NAME` with other prompts or
    sampling settings than its lines were made with is refused, naming them, before a model loads (it replaced
    their lines without a word, two sets drawn as one curve). The same settings again replace a step's line. An
    --input file is filed under file-<its stem>: one named heldout.jsonl went in with the held-out prompts.
    The name in-run is the run's own record (status, resume and the W&B catch-up read it): refused."""
    common = ["eval", held_out, "--steps", "3", "--backend", "hf"]
    refused = cli(*common, "--name", "in-run")
    assert refused.returncode == 2 and ("--name in-run: that is the run's own evaluations (eval.every_steps, "
                                        "RUN_DIR/eval/in-run)") in refused.stderr, refused.stderr
    assert not (held_out / "eval" / "in-run").exists()
    assert cli(*common, "--name", "greedy").returncode == 0
    summary = held_out / "eval" / "greedy" / "summary.jsonl"
    first = summary.read_text()
    refused = cli(*common, "--name", "greedy", "--n", "2", "--temperature", "1")
    assert refused.returncode == 2 and (f"{summary}: step 3 of 'greedy' was evaluated with other settings: n 1 (now "
                                        "2), temperature 0.0 (now 1.0); a name's lines are one curve") in refused.stderr
    assert "give this evaluation a name of its own with --name" in refused.stderr
    given = tmp_path / "heldout.jsonl"
    given.write_text('{"prompt": "Count:"}\n{"prompt": "Numbers and apples:"}\n')
    refused = cli(*common, "--name", "greedy", "--input", given)
    assert refused.returncode == 2, refused.stderr
    assert f'input "held out (data.eval_fraction)" (now "{given.resolve()}"), prompts ' in refused.stderr
    assert summary.read_text() == first
    again = cli(*common, "--name", "greedy")  # (the same settings: step 3 scored again, its line replaced)
    assert again.returncode == 0, again.stderr
    lines = [json.loads(line) for line in summary.read_text().splitlines()]
    assert [r["step"] for r in lines] == [3] and lines[0]["reward_mean"] == json.loads(first)["reward_mean"]
    filed = cli(*common, "--input", given)
    assert filed.returncode == 0, filed.stderr
    filed_under = held_out / "eval" / "file-heldout" / "summary.jsonl"
    rows = [json.loads(line) for line in filed_under.read_text().splitlines()]
    assert [(r["step"], r["prompts"], r["input"]) for r in rows] == [(3, 2, str(given.resolve()))]


def test_eval_follow_scores_each_checkpoint_as_the_run_writes_it_and_ends_with_the_run(tiny, tmp_path):
    """`eval --follow` beside a running run: it scores the checkpoints there, waits while the run goes (held
    in its third training step until eval has scored the first two), scores each next one as it comes, into
    the engine it started with model.actor's weights, and ends once the run has ended, with every
    checkpoint scored once and the same figures a plain `eval` of the ended run gives."""
    import signal
    import subprocess
    import sys
    import time

    from toolkit.hold import held_file

    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 4, "name": "followed", "seed": 4},
                                            trainer={"lr": 0.01}, checkpoint={"every_steps": 1, "keep": 4},
                                            data={"eval_fraction": 0.1}))
    run_dir = tmp_path / "run"
    run, _ = start_held(config, run_dir, "training@3", stdout=subprocess.DEVNULL)
    follow = None
    try:
        deadline = time.monotonic() + 300
        follow = subprocess.Popen([sys.executable, "-m", "toolkit", "eval", str(run_dir), "--follow", "--poll-s", "0.5"],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  start_new_session=True)
        summary = run_dir / "eval" / "heldout" / "summary.jsonl"
        while not (summary.exists() and len(summary.read_text().splitlines()) == 2):
            assert follow.poll() is None and time.monotonic() < deadline + 300, "eval did not score steps 1 and 2"
            time.sleep(0.2)
        time.sleep(2)  # (it waits while the run is held: it must not end, nor score anything more)
        assert follow.poll() is None and len(summary.read_text().splitlines()) == 2
        held_file(run_dir, "training@3").unlink()  # (the run goes on)
        assert run.wait(timeout=300) == 0
        out, _ = follow.communicate(timeout=300)
    finally:
        for proc in (run, follow):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert follow.returncode == 0, out
    assert out.count("(sampling with vllm, started with") == 1 and "the run's first weights, model.actor" in out, out
    assert out.index("waiting for the next checkpoint (its local driver (pid") < out.index("step      3  reward"), out
    followed = [json.loads(line) for line in summary.read_text().splitlines()]
    assert [r["step"] for r in followed] == [1, 2, 3, 4]
    idle = tmp_path / "idle"  # (a run directory with no checkpoint and nothing running it: nothing to wait for)
    idle.mkdir()
    shutil.copy(run_dir / "config.yaml", idle / "config.yaml")
    refused = cli("eval", idle, "--follow", timeout=120)
    assert refused.returncode != 0 and "no checkpoint to score, and the run is not going" in refused.stderr, \
        refused.stderr
    plain = cli("eval", run_dir, "--name", "after")
    assert plain.returncode == 0, plain.stderr
    after = [json.loads(line) for line in (run_dir / "eval" / "after" / "summary.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward_mean"], r["response_len_mean"]) for r in after] == \
        [(r["step"], r["reward_mean"], r["response_len_mean"]) for r in followed]
    status = cli("status", run_dir, timeout=60).stdout  # (a line per set of prompts scored)
    assert f"eval heldout: step 4 reward {followed[-1]['reward_mean']:+.4f} (4 checkpoint(s) scored;" in status, status
    assert "eval after: step 4" in status


@pytest.mark.parametrize("args, message", [
    (["--steps", "9"], "no checkpoint at step(s) 9; it has 2, 3, 4"),
    (["--follow", "--steps", "2"], "--follow scores every checkpoint as the run writes it; leave out --steps"),
    (["--follow", "--poll-s", "0"], "--poll-s 0: give a number of seconds above 0"),
    (["--input", "missing.jsonl"], "--input missing.jsonl: no such file"),
    (["--input", "DIR"], "a directory; give a JSON Lines file of prompts"),  # (it said "no such file")
    (["--name", "../x"], "--name '../x': use letters, digits"),
    ([], "the run holds out no prompts (data.eval_fraction is 0): give prompts to evaluate on with --input FILE"),
    # (each hint names what eval has: it said --max-model-len, which eval lacks, and `set data.prompt_key`, which
    # is the run's; the context is checked before the reward components and the engine load)
    (["--input", "PROMPTS", "--max-new-tokens", "600"],
     "--max-new-tokens 600 are more than the model takes: 512 (max_position_embeddings 512 in"),
    (["--input", "NOKEY"], "nokey.jsonl:1: no non-empty string field 'prompt' (text or chat messages) and no "
                           "'messages' (fields: ['text']); --input is read with the run's data keys: give every row "
                           "its prompt in field 'prompt' (the run's data.prompt_key)"),
])
def test_eval_names_what_is_wrong(trained, prompts, tmp_path, args, message):
    (tmp_path / "nokey.jsonl").write_text('{"text": "hi"}\n')
    files = {"PROMPTS": prompts, "NOKEY": tmp_path / "nokey.jsonl", "DIR": tmp_path}
    result = cli("eval", trained, *[files.get(a, a) for a in args])
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "--max-model-len" not in result.stderr and "set data.prompt_key" not in result.stderr
    assert "Loading" not in result.stderr  # (before any weights load)


def test_chat_answers_each_turn_and_starts_over(trained, greedy):
    """Greedy: the first answer is what `generate` gives for the same user message (prompt "b" of the
    `prompts` file); after `clear` the same question gets the same answer again; `quit` ends."""
    turns = "count to 9\nand again\nclear\ncount to 9\nquit\nnever read\n"
    result = cli("chat", trained, "--temperature", 0, "--max-new-tokens", 12, input=turns)
    assert result.returncode == 0, result.stderr
    answers = [line.removeprefix("model> ") for line in result.stdout.splitlines() if line.startswith("model> ")]
    assert len(answers) == 3 and "(new conversation)" in result.stdout
    assert answers[0] == answers[2]
    assert answers[0] == greedy["vllm"][1]["response"].strip()  # (chat samples with vLLM too: backend auto)


def test_chat_refuses_a_response_longer_than_the_context_before_its_engine_loads(tiny):
    """`chat --max-new-tokens 600` of a model of 512 positions started vLLM, then refused; now it is refused
    first, as `generate` refuses a context the model does not take."""
    result = cli("chat", tiny / "model", "--max-new-tokens", 600, input="hello\n")
    assert result.returncode == 2 and ("--max-new-tokens 600 leaves no room for the conversation in 512 tokens of "
                                       "context (the model's own, at most 2048); give --max-new-tokens below 512"
                                       ) in result.stderr, result.stderr
    assert "Loading safetensors checkpoint shards" not in result.stderr  # (vLLM's engine did not start)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_chat_stopped_by_a_signal_ends_cleanly_and_leaves_no_temporary_files(trained, how):
    """SIGTERM (scancel, a Slurm time limit) or SIGINT while `chat` waits for the next turn: it ends through
    its clean-up, with 128 + the signal, and vLLM's file store goes with its engine (before, SIGTERM
    ended it at once and left /tmp/vllm_dist_* behind). SIGINT is delivered as to the background job of a
    script, which inherits it ignored."""
    import signal
    import subprocess
    import sys

    with short_tmpdir() as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "toolkit", "chat", str(trained), "--max-new-tokens", "4"],
                                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "TMPDIR": str(tmp)},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            proc.stdin.write("count to 9\n")
            proc.stdin.flush()
            assert proc.stdout.readline().startswith("model> ")  # (vLLM is up: an answer came back)
            assert [p.name for p in tmp.iterdir() if p.name.startswith("vllm_dist_")]  # (what must go)
            proc.send_signal(getattr(signal, how))
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 128 + getattr(signal, how) and f"interrupted ({how})" in err, err
        left = left_in(tmp)
        assert not left, f"left in TMPDIR: {left}"


def test_report_draws_the_run_from_its_files(trained, tmp_path):
    import base64
    import html
    import re

    from toolkit.report import plots
    from toolkit.store import experience
    from toolkit.timeline import read_timelines

    result = cli("report", trained, "--out", tmp_path / "report", "--samples-at", "2,4")  # (numbered from 1)
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "report" / "index.html").read_bytes().decode()  # (as written: read_text would turn a
    # response's carriage return into a line break)
    embedded = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)">', page)
    assert [alt for alt, _ in embedded] == ["curves", "step time by phase", "timeline"]
    for (_, data), name in zip(embedded, ("curves", "step_time", "timeline")):
        png = (tmp_path / "report" / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and base64.b64decode(data) == png  # one self-contained page
    # the samples of the chosen steps: the best response of step 4 (experience step-000003) with its reward
    record = experience.read(trained / "experience" / experience.file_name(3))
    best = int(record["samples"]["reward_total"].argmax())
    assert "<h3>step 2 " in page and "<h3>step 4 " in page and "<h3>step 3 " not in page
    assert html.escape(record["meta"]["responses"][best]) in page
    assert f"{float(record['samples']['reward_total'][best]):.4f}" in page
    assert "node group" in page and "algorithm: grpo" in page  # the placement table and the config
    assert "None yet: <code>slurm-rlhf eval RUN_DIR</code>" in page  # (no eval of this run)

    # The timeline files hold each step's phases in causal order: generated, then scored, then trained.
    timelines = read_timelines(trained)
    assert set(timelines) == {"generator-0", "scorer-0", "trainer-0"}

    def began(worker, phase, step):
        return min(r["t"] for r in timelines[worker] if r["phase"] == phase and r["step"] == step)
    for step in range(4):
        assert began("generator-0", "generating", step) < began("scorer-0", "scoring", step) \
            < began("trainer-0", "training", step)
    # the curves are the metrics
    metrics = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    fig = plots.curves(metrics)
    assert list(fig.axes[0].lines[0].get_ydata()) == [m["reward_mean"] for m in metrics]

    for wrong in ("9", "0"):
        result = cli("report", trained, "--out", tmp_path / "r2", "--samples-at", wrong)
        assert result.returncode == 2, result.stderr
        assert f"--samples-at {wrong}: no committed experience of that step; this run has steps 1..4" in result.stderr
    (tmp_path / "a-file").write_text("mine\n")
    result = cli("report", trained, "--out", tmp_path / "a-file")
    assert result.returncode == 2 and "is a file" in result.stderr and (tmp_path / "a-file").read_text() == "mine\n"

    # an experience file damaged since its commit is named on the page (it was a traceback), and the page and
    # its plots are the owner's alone in an --out folder that exists and that everyone can read
    damaged = tmp_path / "damaged"
    shutil.copytree(trained, damaged)
    cut = damaged / "experience" / experience.file_name(1)
    os.truncate(cut, cut.stat().st_size // 2)
    (tmp_path / "public").mkdir(mode=0o755)
    result = cli("report", damaged, "--out", tmp_path / "public", "--samples-at", "2,4")
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "public" / "index.html").read_text()
    assert f"<h3>step 2</h3><p>{cut} cannot be read (" in page and "<h3>step 4 (mean reward" in page
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "public").iterdir()}
    assert set(modes) == {"index.html", "curves.png", "step_time.png", "timeline.png", ".slurm-rlhf-report"} and set(
        modes.values()) == {0o600}, modes


def test_report_writes_only_into_a_folder_of_its_own(trained, tmp_path):
    """`report --out DIR` replaced the index.html of a folder it had not written: such a folder (files, and no
    marker of report's) is refused unless --force. A folder it wrote it writes again, and a figure there that
    has nothing to draw now goes (it stayed beside a page that no longer showed it)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("my page\n")
    refused = cli("report", trained, "--out", site)
    assert refused.returncode == 2 and (f"--out {site} holds files that report did not write (no .slurm-rlhf-report "
                                        "in it)") in refused.stderr and "--force" in refused.stderr, refused.stderr
    assert [p.name for p in site.iterdir()] == ["index.html"] and (site / "index.html").read_text() == "my page\n"
    assert cli("report", trained, "--out", site, "--force").returncode == 0
    assert "slurm-rlhf report: run" in (site / "index.html").read_text() and (site / ".slurm-rlhf-report").exists()
    (site / "evaluation.png").write_bytes((site / "curves.png").read_bytes())  # (a previous report's: of a run
    again = cli("report", trained, "--out", site)  # with evaluations, into the same folder)
    assert again.returncode == 0, again.stderr
    assert not (site / "evaluation.png").exists() and (site / "curves.png").exists()


def test_the_report_renders_in_a_headless_browser(trained, tmp_path):
    """Chromium (tools/test.sh installs chromium-headless-shell) shows the page with its figures: the
    screenshot holds the curves' blue, which only the decoded embedded images can put there."""
    import subprocess

    import numpy as np
    from PIL import Image

    assert cli("report", trained, "--out", tmp_path / "report").returncode == 0
    shot = tmp_path / "shot.png"
    done = subprocess.run(["chromium-headless-shell", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                           "--window-size=1100,1400", (tmp_path / "report" / "index.html").as_uri()],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and shot.exists(), done.stderr
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(int)
    blue = (np.abs(pixels - [31, 119, 180]).sum(axis=1) < 30).sum()  # matplotlib's tab:blue
    assert blue > 2000, blue
