"""A run stopped with its whole process group (a closed terminal, a stopped service: SIGTERM to every process)
takes its local Ray down with it. The driver's last Ray calls (the groups' shutdown) then wait for Ray's GCS to
come back: 60 s by default, a `dmd2 run` stopped so exited after 62 s. A local Ray the project starts gives up
after LOCAL_GCS_RECONNECT_S, in the driver and in every worker (the same stop: 7 s, RELIABILITY.md)."""

import os

import ray

from infra.trainers.cluster import GCS_RECONNECT_SETTING, LOCAL_GCS_RECONNECT_S


@ray.remote(num_cpus=0)
def _worker_setting() -> str | None:
    return os.environ.get(GCS_RECONNECT_SETTING)


def test_a_local_ray_and_its_workers_give_up_on_a_dead_gcs_in_seconds(shared_ray):
    assert os.environ.get(GCS_RECONNECT_SETTING) == LOCAL_GCS_RECONNECT_S
    assert ray.get(_worker_setting.remote()) == LOCAL_GCS_RECONNECT_S
