"""`cpu_omp_bind`: the OpenMP core lists an engine's vLLM workers get on CPU (VLLM_CPU_OMP_THREADS_BIND)."""

from moe_grpo.rollout.vllm_engine import cpu_omp_bind


def test_each_worker_gets_its_own_cores():
    """vLLM 0.32 asserts one '|'-separated list per worker: what a TP=2 engine started after a TP=1 engine in the
    same process (which leaves "0" in the environment) would have been refused with."""
    assert cpu_omp_bind(2, "0", cpus=[0, 1]) == "0|1"
    assert cpu_omp_bind(2, None, cpus=[0, 1, 2, 3]) == "0,1|2,3"
    assert cpu_omp_bind(2, None, cpus=[4, 5, 6]) == "4|5"  # the odd core stays free (vLLM's engine core runs there)
    assert cpu_omp_bind(1, "0|1") == "0"


def test_a_users_binding_is_kept_when_it_fits_the_workers():
    assert cpu_omp_bind(2, "3|5", cpus=[0, 1]) == "3|5"
    assert cpu_omp_bind(1, "2") == "2"
    assert cpu_omp_bind(2, "auto", cpus=[0, 1]) == "0|1"  # vLLM's auto binding wants a NUMA node per worker


def test_more_workers_than_cores_share_them_round_robin():
    assert cpu_omp_bind(4, None, cpus=[0, 1]) == "0|1|0|1"
    assert cpu_omp_bind(2, None, cpus=[1]) == "1|1"
