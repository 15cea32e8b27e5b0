"""A collective that times out on a surviving rank (its peer never joined) is read as a lost rank, which the
distill flow recovers from; the error is a real gloo timeout from a real two-process group."""

import multiprocessing
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from infra.trainers.group import _broken_collective
from infra.trainers.parallel import free_port


def _rank(rank: int, port: int, errors) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))
    if rank == 1:  # joined the group, but never this all-reduce
        time.sleep(10)
        return
    try:
        dist.all_reduce(torch.ones(4))
        errors.put(("no error", "", False))
    except Exception as error:
        errors.put((type(error).__name__, str(error), _broken_collective(error)))


def test_a_timed_out_collective_counts_as_a_lost_rank():
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, errors)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        name, message, broken = errors.get(timeout=120)
    finally:
        for process in ranks:
            process.kill()
            process.join()
    assert "Timed out" in message, (name, message)
    assert broken
