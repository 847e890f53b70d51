"""SLURM's description of a job, read from fake environments: host lists, GPUs and CPUs per node."""

import re
import subprocess

import pytest

from moe_grpo.orchestrator.cluster_env import expand_hostlist, hostnames, local_gpus, slurm_facts


@pytest.mark.parametrize("text, names", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu1", ["gpu1"]),
    ("a1,b[2-3],login", ["a1", "b2", "b3", "login"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("node[008-011]", ["node008", "node009", "node010", "node011"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("gpu-a[1-2]-ib,gpu-b3-ib", ["gpu-a1-ib", "gpu-a2-ib", "gpu-b3-ib"]),
])
def test_compressed_host_lists_expand_as_scontrol_prints_them(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text, needle", [
    ("node[01-04", "unclosed bracket"),
    ("node01-04]", "without '['"),
    ("node[04-01]", "runs backwards"),
    ("node[a-b]", "'a-b' is not a number"),
])
def test_a_host_list_that_does_not_parse_is_refused_naming_the_part(text, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        expand_hostlist(text)


def test_scontrol_expands_when_it_runs_and_the_python_expander_otherwise():
    calls = []

    def scontrol(argv):
        calls.append(list(argv))
        return "c1\nc2\n"

    assert hostnames("c[1-2]", scontrol) == (["c1", "c2"], "scontrol show hostnames")
    assert calls == [["scontrol", "show", "hostnames", "c[1-2]"]]

    def missing(argv):
        raise FileNotFoundError("scontrol")

    def failing(argv):
        raise subprocess.CalledProcessError(1, argv)

    assert hostnames("c[1-2]", missing) == (["c1", "c2"], "expanded here")
    assert hostnames("c[1-2]", failing) == (["c1", "c2"], "expanded here")


JOB = {"SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_NNODES": "4", "SLURM_JOB_NUM_NODES": "4"}


@pytest.mark.parametrize("gpu_env, gpus", [
    ({"SLURM_GPUS_ON_NODE": "8"}, 8),
    ({"SLURM_GPUS_PER_NODE": "h100:8"}, 8),
    ({"SLURM_GPUS_PER_NODE": "4"}, 4),
    ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, 3),
    ({"SLURM_JOB_GPUS": "0,1,2,3"}, 4),
    ({}, None),
])
def test_gpus_per_node_come_from_whichever_variable_slurm_set(gpu_env, gpus):
    facts = slurm_facts({**JOB, **gpu_env}, run=None)
    assert facts.nodes == ("gpu01", "gpu02", "gpu03", "gpu04") and facts.gpus_per_node == gpus
    assert not facts.problems


def test_cpus_per_node_are_the_smallest_node_of_the_job():
    assert slurm_facts({**JOB, "SLURM_JOB_CPUS_PER_NODE": "72(x3),36"}, run=None).cpus_per_node == 36
    assert slurm_facts({**JOB, "SLURM_CPUS_ON_NODE": "128"}, run=None).cpus_per_node == 128


def test_a_node_count_that_disagrees_with_the_list_is_a_problem_naming_both():
    facts = slurm_facts({"SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_NNODES": "4"}, run=None)
    assert facts.problems == ("SLURM_NNODES=4 but SLURM_JOB_NODELIST='gpu[01-03]' names 3 host(s) (expanded here): "
                              "gpu01 gpu02 gpu03",)


def test_outside_slurm_there_is_no_job():
    assert slurm_facts({}, run=None) is None


def test_local_gpus_without_torch(tmp_path):
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert local_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    (tmp_path / "0000:01:00.0").mkdir()
    assert local_gpus({}, proc_gpus=str(tmp_path)) == 1
    assert local_gpus({}, proc_gpus=str(tmp_path / "absent")) is None
