"""Placement arithmetic (no Spark needed): GPU by partition index, bounded CPU threads per task."""

from __future__ import annotations

import pytest

from bertopt.spark.placement import Placement, choose_placement, concurrent_tasks_for


@pytest.mark.parametrize("partition, n_gpus, device", [(0, 2, 0), (1, 2, 1), (2, 2, 0), (7, 4, 3), (5, 1, 0),
                                                       (9, 3, 0), (10, 3, 1)])
def test_gpu_is_partition_index_modulo_gpu_count(partition, n_gpus, device):
    placement = choose_placement(partition, n_gpus=n_gpus, cores=8, concurrent_tasks=4)
    assert placement == Placement("cuda", device, 2)


def test_partitions_spread_evenly_over_gpus():
    devices = [choose_placement(p, n_gpus=4, cores=16, concurrent_tasks=4).device_id for p in range(64)]
    assert [devices.count(d) for d in range(4)] == [16, 16, 16, 16]


def test_gpu_assigned_by_spark_resource_scheduling_wins():
    placement = choose_placement(5, n_gpus=4, cores=16, concurrent_tasks=4, assigned_gpus=["2"])
    assert (placement.provider, placement.device_id) == ("cuda", 2)


@pytest.mark.parametrize("cores, concurrent, threads", [(2, 2, 1), (8, 2, 4), (8, 3, 2), (16, 4, 4), (1, 4, 1),
                                                        (4, 1, 4), (3, 8, 1)])
def test_cpu_threads_are_cores_over_concurrent_tasks_at_least_one(cores, concurrent, threads):
    placement = choose_placement(3, n_gpus=0, cores=cores, concurrent_tasks=concurrent)
    assert placement == Placement("cpu", None, threads)
    # the executor's concurrent tasks never ask for more threads than it has cores (unless 1 each)
    assert placement.threads * concurrent <= max(cores, concurrent)


def test_explicit_thread_count_overrides_the_share():
    assert choose_placement(0, n_gpus=0, cores=8, concurrent_tasks=2, threads=3).threads == 3


def test_negative_partition_is_rejected():
    with pytest.raises(ValueError, match="partition index"):
        choose_placement(-1, n_gpus=2, cores=4, concurrent_tasks=2)


@pytest.mark.parametrize("master, cores, task_cpus, cpu_count, expected", [
    ("local[2]", None, None, 8, 2), ("local[*]", None, None, 8, 8), ("local", None, None, 8, 1),
    ("local[4, 3]", None, None, 8, 4), ("local[4]", None, "2", 8, 2), ("local-cluster[2, 3, 1024]", None, None, 8, 3),
    ("spark://h:7077", "4", None, 64, 4), ("yarn", "8", "2", 64, 4), ("yarn", None, None, 64, 1),
    ("k8s://https://h", "2", "4", 64, 1)])
def test_concurrent_tasks_from_spark_conf(master, cores, task_cpus, cpu_count, expected):
    assert concurrent_tasks_for(master, cores, task_cpus, cpu_count=cpu_count) == expected
