"""Each rank's own compute time (hetseq/update/stats.py): what capacity planning and
rebalancing read. A rank that waits for a slower one inside a collective must
not count the wait as its own work.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/update/test_timing.py."""

import pytest
import torch

from machinery.in_process import build_controller, leave_process_group, rank_queue, start_ranks
from machinery.settings import GROUP_TIMEOUT, TOY


SLEEP_MS = 100     # rank 1 sleeps this per sample before its forward: 0.3 s an update


def _times(rank, world, init, zero, out):
    import torch.distributed as dist

    from hetseq.distributed.spawn import DistContext
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    controller, task = build_controller(
        [*TOY, "--optimizer", "sgd", "--lr", "0.1", "--zero", zero, "--toy-slow-rank", 1,
         "--toy-slow-ms", SLEEP_MS], ctx)
    data = task.load_dataset("train")
    batch = {"x": data.x[:3], "y": data.y[:3]}
    results = [controller.train_step([batch], batch) for _ in range(5)]
    if rank == 0:
        # A result holds the previous update's times. DDP rebuilds its buckets
        # in the second update's forward (a broadcast rank 0 waits in): from 3 on.
        out.put([result.ranks.seconds for result in results[3:]])
    del controller
    leave_process_group()


@pytest.mark.parametrize("zero", [0, 3])
def test_a_rank_waiting_for_a_slower_one_does_not_count_the_wait(tmp_path, zero):
    """Rank 1 sleeps 0.3 s before each forward. Under DDP rank 0 waits in the
    gradient all-reduce, after its backward; under FSDP (--zero 3) inside
    the parameters' all-gathers of forward and backward. Either way its
    compute time stays far below rank 1's."""
    queue = rank_queue()
    start_ranks(_times, 2, 2, f"file://{tmp_path / 'meet'}", zero, queue)
    for fast, slow in queue.get():
        assert slow >= 3 * SLEEP_MS / 1000
        assert 0 < fast < slow / 3, (fast, slow)
