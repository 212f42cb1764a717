"""Slurm allocation planning and srun commands (pure: no Slurm needed)."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from tests.conftest import example, write_config
from toolkit.config import load_config
from toolkit.errors import ConfigError
from toolkit.launch.allocation import assign_nodes, plan_allocation
from toolkit.launch.slurm import STEP_ID, TASK_FAILED, srun_command
from toolkit.placement.plan import plan


def groups_for(tiny, tmp_path, **placement):
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, placement=placement,
                                                     trainer={"micro_batch_size": 8})))
    return cfg, plan(cfg)


def test_one_job_when_groups_fit_together(tiny, tmp_path):
    _, groups = groups_for(tiny, tmp_path, trainer={"workers": 4, "nodes": 2, "cpus_per_worker": 2})
    a = plan_allocation(groups)
    assert not a.heterogeneous and a.nodes == 4
    (c,) = a.components
    assert (c.tasks_per_node, c.cpus_per_task, c.gpus_per_task) == (2, 2, 0)  # the most any group needs per node
    nodes = assign_nodes(a, [["n1", "n2", "n3", "n4"]])
    assert nodes == {"generator": ["n1"], "scorer": ["n2"], "trainer": ["n3", "n4"]}


def test_heterogeneous_when_partitions_or_gpus_differ(tiny, tmp_path):
    _, groups = groups_for(tiny, tmp_path, generator={"partition": "front"}, trainer={"partition": "back"})
    a = plan_allocation(groups)
    assert a.heterogeneous and [c.partition for c in a.components] == ["front", None, "back"]
    assert assign_nodes(a, [["n1"], ["n2"], ["n4"]]) == {"generator": ["n1"], "scorer": ["n2"], "trainer": ["n4"]}
    _, groups = groups_for(tiny, tmp_path / "g", trainer={"gpus_per_worker": 1})
    assert plan_allocation(groups).heterogeneous
    assert len(plan_allocation(groups, "always").components) == 3
    with pytest.raises(ConfigError, match="different partitions"):
        plan_allocation(groups_for(tiny, tmp_path / "n", trainer={"partition": "back"})[1], "never")


def test_groups_split_the_gpus_of_the_same_nodes(tiny, tmp_path):
    """OpenRLHF's usual layout: on each 8-GPU node, 4 GPUs of vLLM engines and 4 of training."""
    cfg, groups = groups_for(tiny, tmp_path, generator={"workers": 8, "nodes": 2, "gpus_per_worker": 1,
                                                         "cpus_per_worker": 4, "same_nodes_as": "trainer",
                                                         "mem_gb": 200},
                             trainer={"workers": 8, "nodes": 2, "gpus_per_worker": 1, "cpus_per_worker": 8,
                                      "mem_gb": 300},
                             scorer={"gpus_per_worker": 1, "mem_gb": 500})  # (one job: the same memory)
    a = plan_allocation(groups)
    assert not a.heterogeneous and a.nodes == 3  # the scorer's node and the two shared ones
    (c,) = a.components
    assert (c.tasks_per_node, c.cpus_per_task, c.gpus_per_task, c.gpus_per_node) == (8, 8, 1, None)
    nodes = assign_nodes(a, [["n1", "n2", "n3"]])
    assert nodes == {"scorer": ["n1"], "trainer": ["n2", "n3"], "generator": ["n2", "n3"]}
    from toolkit.launch.sbatch import _resources, sbatch_script

    script = sbatch_script(cfg, a, "/runs/x", ["true"], how="render")
    assert "#SBATCH --nodes=3" in script and "#SBATCH --ntasks-per-node=8" in script
    assert "#SBATCH --gpus-per-task=1" in script and "#SBATCH --mem=500G" in script  # (the node set's sum)
    # Both steps of a shared node set take only what they ask for; a step on nodes of its own, everything
    generator, scorer, trainer = (next(g for g in groups if g.name == n) for n in ("generator", "scorer", "trainer"))
    assert {"--exact", "--mem=200G", "--gpus-per-task=1", "--nodelist=n2,n3"} <= set(srun_command(
        generator, ["n2", "n3"], None, "py", "/l", shared=True))
    from toolkit.launch.allocation import shares_nodes

    assert shares_nodes(trainer, groups) and shares_nodes(generator, groups) and not shares_nodes(scorer, groups)
    assert "--exact" not in srun_command(scorer, ["n1"], None, "py", "/l")
    # TP 2 engines beside 1-GPU trainer ranks: the node's GPUs add up (gpus-per-node, not per task)
    _, groups = groups_for(tiny, tmp_path / "tp", generator={"workers": 2, "gpus_per_worker": 2,
                                                             "same_nodes_as": "trainer"},
                           trainer={"workers": 4, "gpus_per_worker": 1})
    a = plan_allocation(groups)
    assert a.heterogeneous  # (the scorer has no GPU)
    c = a.components[a.component_of(next(g for g in groups if g.name == "trainer"))]
    assert [g.name for g in c.groups] == ["trainer", "generator"] and c.nodes == 1
    assert (c.tasks_per_node, c.gpus_per_node) == (6, 8)
    assert _resources(c)["gpus-per-node"] == 8 and _resources(c)["gpus-per-task"] is None


def test_groups_sharing_nodes_split_the_jobs_memory(tiny, tmp_path):
    """Where Slurm counts memory (CR_*_Memory) and the job has memory per node (a cluster's DefMemPerNode, or
    sbatch's SBATCH_MEM_PER_NODE), a job step that asks for none takes all of it on its nodes: the trainer's
    step beside the generator's waited for it (srun: 'Cancelled pending job step' when the local cluster, set
    to CR_CPU_Memory, timed the run's start-up out: tests/slurm/test_placement.py). Each step of a shared node
    set now asks for its CPUs' share; one group's mem_gb alone in a set left the others none and is a config error."""
    from toolkit.launch.allocation import shares_nodes, step_mem_mb

    _, groups = groups_for(tiny, tmp_path, generator={"workers": 2, "cpus_per_worker": 1, "same_nodes_as": "trainer"},
                           trainer={"workers": 2, "cpus_per_worker": 3})
    generator, scorer, trainer = (next(g for g in groups if g.name == n) for n in ("generator", "scorer", "trainer"))
    assert [step_mem_mb(g, groups, 16000) for g in (generator, trainer, scorer)] == [4000, 12000, 16000]
    assert step_mem_mb(generator, groups, None) is None  # (memory per CPU, or none counted: Slurm's share)
    command = srun_command(generator, ["n2"], None, "py", "/l", shares_nodes(generator, groups),
                           step_mem_mb(generator, groups, 16000))
    assert {"--exact", "--mem=4000M"} <= set(command)
    _, groups = groups_for(tiny, tmp_path / "asked", generator={"same_nodes_as": "trainer", "mem_gb": 8},
                           trainer={"mem_gb": 24})
    assert [step_mem_mb(g, groups, 32768) for g in groups if g.name != "scorer"] == [None, None]
    with pytest.raises(ConfigError) as error:
        groups_for(tiny, tmp_path / "one", generator={"same_nodes_as": "trainer", "mem_gb": 8})
    assert str(error.value).endswith(
        "placement.generator.mem_gb is set and placement.trainer.mem_gb is not, but they share nodes: the job asks "
        "Slurm for the sum of their mem_gb on each node, which leaves trainer none where Slurm counts memory (each "
        "job step takes only what it asks for there); give trainer mem_gb too, or neither")


def test_memory_of_one_group_does_not_cap_the_nodes_of_the_others(tiny, tmp_path):
    """One job's --mem holds on every node: `scorer: {mem_gb: 16}` gave the trainer's nodes, which ask for
    none (their partition's default), 16 GB each too, while the placement table said '-' for them."""
    from toolkit.launch.sbatch import _resources

    _, groups = groups_for(tiny, tmp_path, scorer={"mem_gb": 16}, trainer={"workers": 4, "nodes": 2})
    a = plan_allocation(groups)
    assert a.heterogeneous and a.nodes == 4
    memory = {g.name: _resources(a.components[a.component_of(g)])["mem"] for g in groups}
    assert memory == {"generator": None, "scorer": "16G", "trainer": None}
    with pytest.raises(ConfigError) as error:
        plan_allocation(groups, "never")
    assert str(error.value) == (
        "slurm.heterogeneous is 'never', so every node of the job gets the same memory, but placement.<group>.mem_gb "
        "is set for scorer 16 and not for generator, trainer (their partition's default); give those groups mem_gb "
        "too, or allow a heterogeneous job")
    # The same memory everywhere, or asked for by every node set under `never`: one job, the most of them
    _, groups = groups_for(tiny, tmp_path / "all", generator={"mem_gb": 8}, scorer={"mem_gb": 16},
                           trainer={"mem_gb": 16})
    (c,) = plan_allocation(groups, "never").components
    assert c.mem_gb == pytest.approx(16)
    assert not plan_allocation(groups_for(tiny, tmp_path / "same", **{n: {"mem_gb": 16} for n in (
        "generator", "scorer", "trainer")})[1]).heterogeneous


def test_same_nodes_as_errors(tiny, tmp_path):
    def load(**placement):
        return load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, placement=placement)))

    with pytest.raises(ConfigError, match=r"placement.generator.same_nodes_as is 'trainers', not another node group "
                                          r"of this placement \(scorer, trainer\)"):
        load(generator={"same_nodes_as": "trainers"})
    with pytest.raises(ConfigError, match=r"placement.generator.nodes is 1, but it runs on the nodes of trainer, "
                                          r"which has 2; give both the same nodes"):
        load(generator={"same_nodes_as": "trainer"}, trainer={"nodes": 2, "workers": 2})
    with pytest.raises(ConfigError, match="names scorer, which runs on the nodes of trainer itself; name trainer"):
        load(generator={"same_nodes_as": "scorer"}, scorer={"same_nodes_as": "trainer"})
    with pytest.raises(ConfigError, match="cannot ask for another partition or constraint"):
        load(generator={"same_nodes_as": "trainer", "partition": "front"})
    two = {"slurm": {"nodes": 2}}  # a generator on the trainer's nodes needs none of its own
    with pytest.raises(ConfigError, match=r"need 3 nodes \(generator 1, scorer 1, trainer 1\) but slurm.nodes allows 2"):
        load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, **two)))
    load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, placement={"generator": {
        "same_nodes_as": "trainer"}}, **two)))


def test_too_few_nodes_is_reported(tiny, tmp_path):
    _, groups = groups_for(tiny, tmp_path, trainer={"workers": 2, "nodes": 2})
    with pytest.raises(RuntimeError, match="has 3 nodes"):
        assign_nodes(plan_allocation(groups), [["n1", "n2", "n3"]])


def test_placement_and_sbatch_errors(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny, placement={"trainer": {"workers": 3, "nodes": 2}})
    with pytest.raises(ConfigError, match=r"workers \(3\) must be a multiple of nodes \(2\)"):
        load_config(write_config(tmp_path, data))
    data = example("tiny-grpo.yaml", tiny, slurm={"sbatch": {"nodes": 9}})
    with pytest.raises(ConfigError, match="--nodes is set by slurm-rlhf"):
        load_config(write_config(tmp_path, data))
    data = example("tiny-grpo.yaml", tiny, slurm={"sbatch": {"Mail Type": "END"}})
    with pytest.raises(ConfigError, match="not an sbatch option name"):
        load_config(write_config(tmp_path, data))


def test_srun_command(tiny, tmp_path):
    _, groups = groups_for(tiny, tmp_path, trainer={"workers": 4, "nodes": 2, "cpus_per_worker": 3,
                                                    "gpus_per_worker": 1})
    trainer = groups[2]
    cmd = srun_command(trainer, ["n3", "n4"], 2, "/venv/bin/python", "/runs/x/logs")
    assert cmd[:2] == ["srun", "--het-group=2"]
    for flag in ("--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--nodelist=n3,n4", "--cpus-per-task=3",
                 "--gpus-per-task=1", "--kill-on-bad-exit=1", "--output=/runs/x/logs/trainer-%t.log",
                 "--export=ALL"):  # (before: none, and a job submitted with --export=NONE gave its workers no env)
        assert flag in cmd, flag
    assert cmd[-3:] == ["/venv/bin/python", "-m", "toolkit.worker"]
    assert not any(a.startswith("--het-group") for a in srun_command(groups[0], ["n1"], None, "py", "/l"))


def test_memory_is_asked_for_in_whole_units():
    """Slurm takes whole numbers: 1.5 GB once went out as --mem=1.5G."""
    from toolkit.launch.allocation import mem_option

    assert [mem_option(gb) for gb in (16, 480.0, 1.5, 0.0001)] == ["16G", "480G", "1536M", "1M"]


def test_srun_reports_are_parsed():
    # lines as srun 22.05 writes them (seen on the local cluster)
    text = ("srun: launching StepId=45314686.1 on host n2, 1 tasks: 0\n"
            "srun: error: n3: task 1: Killed\n"
            "srun: error: n2: task 0: Terminated\n")
    assert STEP_ID.search(text)["step"] == "45314686.1"
    first = TASK_FAILED.search(text)
    assert (first["node"], first["tasks"], first["what"]) == ("n3", "1", "Killed")


def test_a_step_that_srun_could_not_start_is_blamed_on_what_srun_said(tmp_path):
    """srun can fail before any task runs (the step's memory is not free, say): no worker log is written,
    and the error named only `srun step ? ended` and a worker log that does not exist."""
    import subprocess

    from toolkit.launch.rundir import RunDir
    from toolkit.launch.slurm import SlurmLauncher

    launcher = object.__new__(SlurmLauncher)  # (its state as `start` leaves it; no Slurm here)
    launcher.run_dir, launcher._reported, launcher._log_from = RunDir(tmp_path), set(), {}
    launcher.run_dir.logs.mkdir(parents=True)
    launcher.srun_log("generator").write_text(
        "$ srun --verbose ...\nsrun: error: Unable to create step for job 4242: Memory required by task is not "
        "available\n")
    launcher.steps = {"generator": subprocess.Popen(["sh", "-c", "exit 1"])}
    launcher.steps["generator"].wait()
    [ended] = launcher.poll()
    assert (ended.worker_id, ended.code) == ("generator:0", 1)
    assert ended.detail == ("srun step ? ended: srun: error: Unable to create step for job 4242: Memory required by "
                            f"task is not available (srun's log: {tmp_path}/logs/srun-generator.log)")


def test_bind_host_is_an_address_an_interface_or_a_network_resolved_on_each_node(monkeypatch):
    from toolkit.launch import env

    monkeypatch.setattr(env, "interface_addresses", lambda: {"lo": ["127.0.0.1"], "eth0": ["192.0.2.2"],
                                                             "ib0": ["10.1.4.7"], "ifb0": []})
    assert env.resolve_bind_host("ib0") == "10.1.4.7"
    assert env.resolve_bind_host("10.1.0.0/16") == "10.1.4.7"
    assert env.resolve_bind_host("192.0.2.2") == "192.0.2.2"
    with pytest.raises(ConfigError, match=r"10\.9\.0\.0/16: no address of node .* is in that network \(its "
                                          r"interfaces: lo 127\.0\.0\.1, eth0 192\.0\.2\.2, ib0 10\.1\.4\.7, ifb0 -\)"):
        env.resolve_bind_host("10.9.0.0/16")
    with pytest.raises(ConfigError, match="'ifb0': that interface of node .* has no IPv4 address"):
        env.resolve_bind_host("ifb0")
    # an interface this node lacks, or an address not its own: ZeroMQ failed to bind, a traceback
    for wrong in ("ib1", "10.9.9.9"):
        with pytest.raises(ConfigError, match=f"transport.bind_host '{wrong}' is not an interface, an address or a "
                                              r"network of node .* \(its interfaces: lo 127\.0\.0\.1, eth0"):
            env.resolve_bind_host(wrong)
    assert env.resolve_bind_host("localhost") == "127.0.0.1"  # (a name of one of its addresses)
    # The default: the node's name resolved, but not to a loopback address (Debian's 127.0.1.1), which
    # the other nodes of a job cannot reach
    monkeypatch.setattr(env.socket, "gethostbyname", lambda name: "127.0.1.1")
    assert env.resolve_bind_host(None) == "192.0.2.2"
    monkeypatch.setattr(env.socket, "gethostbyname", lambda name: "10.1.4.7")
    assert env.resolve_bind_host("") == "10.1.4.7"
    monkeypatch.setattr(env, "interface_addresses", lambda: {"lo": ["127.0.0.1"]})
    monkeypatch.setattr(env.socket, "gethostbyname", lambda name: "127.0.1.1")
    assert env.node_address() == "127.0.1.1"  # (a machine with nothing else)
    assert env.interface_of("127.0.0.1") == "lo" and env.interface_of("10.0.0.1") is None


def test_tasks_started_again_each_listen_on_the_port_of_their_rank(tiny, tmp_path):
    """The tasks of a Slurm step started again share one environment: each takes its own rank's port;
    a rank with none (or no variable: a first start) listens where the system puts it."""
    from toolkit.launch import env
    from toolkit.launch.slurm import SlurmLauncher

    base = {env.RUN_DIR: "/r", env.CONTROL: "tcp://h:1", env.SECRET_FILE: "/s", env.ATTEMPT: "a", env.GROUP: "generator",
            env.BIND_HOST: "127.0.0.1"}
    started = env.inbox_ports({1: 40002, 0: 40001})
    assert started == {env.INBOX_PORT: "0:40001,1:40002"}
    assert [env.WorkerEnv.from_environ({**base, **started, "SLURM_PROCID": str(r)}).inbox_port
            for r in range(3)] == [40001, 40002, None]
    assert env.WorkerEnv.from_environ({**base, "SLURM_PROCID": "0"}).inbox_port is None
    assert env.inbox_ports({}) == {}
    launcher = SlurmLauncher.__new__(SlurmLauncher)  # (what it starts again: its groups alone)
    _, groups = groups_for(tiny, tmp_path, generator={"workers": 3})
    launcher.groups = {g.name: g for g in groups}
    assert launcher.restarts_with("generator:1") == ["generator:0", "generator:1", "generator:2"]
    assert launcher.restarts_with("scorer:0") == ["scorer:0"]


def test_the_jobs_end_is_read_from_squeue_within_a_limit(monkeypatch, tmp_path):
    """The driver asks squeue when its job ends (after SIGUSR1); a controller that does not answer within
    END_TIME_TIMEOUT_S gives None (the driver stops as if the end were now), where the TimeoutExpired was
    raised out of the driver's signal handler. squeue here is a script on PATH that answers or hangs."""
    import datetime
    import types

    from toolkit.launch import slurm

    squeue = tmp_path / "squeue"
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(slurm, "END_TIME_TIMEOUT_S", 1.0)
    launcher = types.SimpleNamespace(job_id="7")
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")  # (a user's: squeue would print `Tomorr 20:15`)
    standard = 'if [ "$SLURM_TIME_FORMAT" = standard ]; then echo 2026-12-04T20:15:00; else echo Tomorr 20:15; fi'
    for script, expected in [(standard, datetime.datetime(2026, 12, 4, 20, 15).timestamp()),
                             ("echo NONE", None), ("exec sleep 60", None), ("exit 1", None)]:
        squeue.write_text(f"#!/bin/sh\n{script}\n")
        squeue.chmod(0o700)
        started = time.monotonic()
        assert slurm.SlurmLauncher.end_time(launcher) == expected, script
        assert time.monotonic() - started < 30, script  # (the hung one is killed at the limit, 1 s)


def test_a_scancel_that_does_not_answer_in_time_is_logged_not_raised(monkeypatch, tmp_path, caplog):
    """The driver kills a hung worker's step with scancel before starting it again; a controller that did
    not answer within SCANCEL_TIMEOUT_S raised TimeoutExpired out of the driver (a real run on this
    cluster ended so, its status.json still saying `running`). Now it is logged, and the launcher goes on
    to kill the step's srun. scancel here is a script on PATH that hangs, or fails."""
    from toolkit.launch import slurm

    scancel = tmp_path / "scancel"
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(slurm, "SCANCEL_TIMEOUT_S", 1.0)
    for script, said in [("exec sleep 60", "timed out after 1.0 seconds"), ("exit 1", None)]:
        scancel.write_text(f"#!/bin/sh\n{script}\n")
        scancel.chmod(0o700)
        caplog.clear()
        started = time.monotonic()
        slurm._kill_step("7.2")
        assert time.monotonic() - started < 30, script  # (the hung one is killed at the limit, 1 s)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert (warned == [f"scancel --signal=KILL 7.2: Command '['scancel', '--signal=KILL', '7.2']' {said}; "
                           "killing its srun instead"]) if said else warned == [], warned


def test_a_worker_lives_through_sigusr1_meant_for_the_driver(tmp_path):
    """`scancel --signal=USR1 JOB` (without -b) reaches the job steps: every worker died of it (exit 138)
    and a trainer restart was used up. A worker ignores it from its first line. Here the worker's start
    stops where it reads its environment: it sends itself SIGUSR1 there, and must live on to say so."""
    import subprocess
    import sys

    from tests.conftest import REPO

    script = tmp_path / "start.py"
    script.write_text("import os, signal, sys\nimport toolkit.launch.env as E\nimport toolkit.worker as w\n"
                      "def read_env(*args):\n    os.kill(os.getpid(), signal.SIGUSR1)\n    print('alive')\n"
                      "    sys.exit(0)\nE.WorkerEnv.from_environ = read_env\nw.main()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (out.returncode, out.stdout) == (0, "alive\n"), out.stderr[-2000:]


def test_a_partition_that_does_not_exist_is_named_before_the_submit(tiny, tmp_path, monkeypatch):
    """A misspelt partition went to sbatch, which refused it after the run directory was made. sinfo here is
    a script on PATH (a fake: no cluster in the unit tests) listing the partitions debug (default) and gpu."""
    from toolkit.launch.submit import check_partitions

    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    (tmp_path / "sinfo").write_text("#!/bin/sh\nprintf 'debug* 0/4/0/4\\ngpu 0/2/0/2\\n'\n")
    (tmp_path / "sinfo").chmod(0o700)
    _, groups = groups_for(tiny, tmp_path / "a", trainer={"partition": "gpus"})
    with pytest.raises(ConfigError) as e:
        check_partitions(plan_allocation(groups))
    assert e.value.exit_code == 2
    assert str(e.value) == ("placement.trainer.partition: there is no partition 'gpus' on this cluster (sinfo lists "
                            "debug (default), gpu); name one of those")
    _, groups = groups_for(tiny, tmp_path / "b", trainer={"partition": "gpu"})  # (the rest: slurm.partition cpu)
    groups = [g if g.partition else dataclasses.replace(g, partition="cpu") for g in groups]
    with pytest.raises(ConfigError, match=r"^slurm.partition: there is no partition 'cpu' on this cluster"):
        check_partitions(plan_allocation(groups), "cpu")
    check_partitions(plan_allocation(groups_for(tiny, tmp_path / "c", trainer={"partition": "gpu"})[1]))
