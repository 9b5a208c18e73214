"""State shares by memory (--state-shares memory, hetseq/update/zero/uneven.py):
units gathered and freed as --zero 2/3 promise, a model whose even share
does not fit the small rank trains with shares by memory, the refusals.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/update/test_uneven.py."""

import re

import pytest
import torch

from machinery.commands import assert_ok, final_params, run_job, run_nodes
from machinery.in_process import (alone, keyed, leave_process_group, max_diff, portable,
                                  rank_queue, start_ranks, unpack)
from machinery.settings import EXACT, EXACT_SGD, GROUP_TIMEOUT
from unit.update.test_uneven import BLOCKS


def _gathered_while_training(rank, world, init, zero, out):
    """Rank ``rank`` of a 1:3 split: how many units were gathered during
    each block's forward and backward, and what is left gathered after."""
    import torch.distributed as dist
    from hetseq.app import cli
    from hetseq.distributed.spawn import DistContext
    from hetseq.tasks import TASKS
    from hetseq.update.controller import Controller
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    args, job, _ = cli.parse([str(a) for a in [*BLOCKS, "--zero", zero]])
    task = TASKS.get(args.task)(args)
    controller = Controller(job, task, task.build_model(), ctx, state_shares=[0.25, 0.75])
    flats = [flat for _, flat in controller.sharding.flats]
    seen = {"forward": [], "backward": []}

    def count(kind):
        seen[kind].append(sum(flat.gathered for flat in flats))
        # Whole gradients held from an earlier micro-batch: none (reduced at once).
        seen.setdefault("whole grads", []).append(
            sum(p.grad is not None for flat in flats for p in flat.params))

    def at_backward(module, args, output):
        output.register_hook(lambda grad: count("backward"))

    # Registered after the mode's own hooks: these see a block while it runs
    # (its forward, and its backward from the moment its output's gradient is there).
    for block in controller.model.blocks:
        block.register_forward_pre_hook(lambda *_: count("forward"))
        block.register_forward_hook(at_backward)
    data = task.load_dataset("train")
    first, second = (keyed(data, list(range(8 * rank + 4 * i, 8 * rank + 4 * i + 4)))
                     for i in range(2))
    controller.train_step([first, second], first)       # two micro-batches
    left = [flat.full.untyped_storage().nbytes() for flat in flats]
    # A gradient range is its own storage (a view of the unit's whole
    # gradient once kept that alive: memory the ranks' counts never saw).
    grads = [(flat.grad.untyped_storage().nbytes(), flat.grad.nbytes)
             for flat in flats]
    owned = [flat.hi - flat.lo for flat in flats]
    out.put(portable((seen, left, owned, [flat.numel for flat in flats], grads)))
    del controller
    leave_process_group()


@pytest.mark.parametrize("zero", [2, 3])
def test_units_are_gathered_while_they_run_and_freed_after(tmp_path, zero):
    """--zero 3 holds the root and one block at a time (a block is freed
    after its forward and gathered again for its backward); --zero 2 keeps
    each from its forward to its backward. No whole gradient waits for the
    next micro-batch (the memory the plan counts). After the update no unit
    is gathered, and each rank owns its fraction (1:3) of every unit."""
    queue = rank_queue()
    start_ranks(_gathered_while_training, 2, 2, f"file://{tmp_path / 'meet'}", zero, queue)
    results = [unpack(queue.get()) for _ in range(2)]
    for seen, left, owned, numels, grads in results:
        assert all(storage == size for storage, size in grads), grads
        if zero == 3:
            assert seen["forward"] == [2, 2, 2] * 2 and seen["backward"] == [2, 2, 2] * 2, seen
        else:
            assert seen["forward"] == [2, 3, 4] * 2 and seen["backward"] == [4, 3, 2] * 2, seen
        # At a block's forward no parameter holds a gradient (the first
        # micro-batch's went to the owners); in backward only its own units'.
        assert seen["whole grads"][:3] == seen["whole grads"][6:9] == [0, 0, 0], seen
        assert left == [0] * len(left)
    owned = sorted((result[2] for result in results), key=sum)
    numels = results[0][3]
    for small, big, numel in zip(*owned, numels):
        assert small + big == numel and abs(small - numel / 4) <= 1, (owned, numels)


# The toy of 40 blocks of 128: 5.3 MB of float64 parameters, 21 MB of state
# with gradients and Adam's two moments; under --zero 3 a rank also gathers
# one block (0.26 MB with its gradient). Rank 0 has 8 MB, rank 1 25 MB.
BIG = [*EXACT_SGD, "--optimizer", "adamw", "--lr", "0.01", "--toy-width", 128,
       "--toy-blocks", 40, "--max-update", 2, "--no-save", "--zero", 3]


MEMORIES = [["--max-sentences", 16, "--max-memory-gb", 0.008],
            ["--max-sentences", 16, "--max-memory-gb", 0.024]]


def test_a_model_too_big_for_the_small_ranks_even_share_trains_with_shares_by_memory():
    """Half of 21 MB does not fit rank 0's 8 MB: even shares are refused
    before the first update, in one line that names the rank, its memory,
    what its share needs and the fix. By memory (auto: the memories differ
    by more than 10%) each rank holds its fraction, and the bytes each
    counts from its own tensors, checked against its memory before the
    first update (plan/startup.py), are printed in the plan."""
    refused = run_job([*BIG, "--state-shares", "even"], MEMORIES)
    code, out = refused[0]
    assert code == 2 and "Traceback" not in out, out[-2000:]
    line = re.search(r"rank 0 has 0.008 GB for model state and its even share under --zero 3 "
                     r"needs 0.01\d+ GB .*--state-shares memory would fit \(2[\d.]+%, 7[\d.]+%\)", out)
    assert line, out[-2000:]
    trained = run_job(BIG, MEMORIES)
    assert_ok(trained)
    out = trained[0][1]
    assert re.search(r"state shares by memory \(ranks' memories 0.008, 0.024 GB differ", out), \
        out[-2000:]
    shares = re.findall(r"batch 16 in 1 micro-batch\(es\), state ([\d.]+) MB \(([\d.]+)%\)", out)
    assert len(shares) == 2, out[-2000:]
    (small, small_share), (big, big_share) = [(float(mb), float(p)) for mb, p in shares]
    assert small < 8 * 1.024 and big < 24 * 1.024 and 20 < small_share < 30 < 70 < big_share
    assert abs(big / small - big_share / small_share) < 0.05 * big / small, shares


def test_shares_by_memory_leave_each_rank_room_for_its_activations(tmp_path):
    """Equal memories, micro-batches of 48 and 8: after the plan each rank's
    activations at its micro-batch are measured on the wrapped model and
    taken off its memory, so the rank with the larger micro-batch holds the
    smaller share (the state moves before the first update), and the
    update is still one process's."""
    common = [*EXACT_SGD, "--max-update", 2, "--toy-width", 128, "--toy-blocks", 40,
              "--zero", 3, "--state-shares", "memory"]
    result = run_job([*common, "--save-dir", tmp_path / "run"],
                     [["--max-sentences", 48, "--max-memory-gb", 0.02],
                      ["--max-sentences", 8, "--max-memory-gb", 0.02]])
    assert_ok(result)
    out = result[0][1]
    line = re.search(r"memories 0.02, 0.02 GB less their activations at their micro-batches, "
                     r"([\d.e-]+), ([\d.e-]+) GB\): ([\d.]+)%, ([\d.]+)%", out)
    assert line, out[-2000:]
    big, small, first, second = map(float, line.groups())
    assert 5.5 < big / small < 6.5            # activations follow the micro-batch
    # s_r proportional to memory - whole (one gathered block and its gradient) - activations
    whole = 2 * (128 * 128 + 128) * 8 / 2 ** 30
    room = [0.02 - whole - big, 0.02 - whole - small]
    assert abs(first / 100 - room[0] / sum(room)) < 0.002 and first + second == pytest.approx(100)
    assert re.search(rf"batch 48 in 1 micro-batch\(es\), state [\d.]+ MB \({first}%\)", out)
    reference = alone(*common[:-4], "--max-sentences", 56)["model"]
    assert max_diff(reference, final_params(tmp_path / "run")) < EXACT


SPARE = [*BLOCKS, "--toy-spare-above", 1000, "--momentum", 0.9]     # spares never used


def test_a_checkpoint_with_parameters_without_optimizer_state_resumes_by_memory(tmp_path):
    """One process leaves the never-used spares without momentum; --zero 2
    by memory resumes it (their pieces get no state, the others theirs),
    equals the run never interrupted, and saves the same format back."""
    straight = run_nodes([[*SPARE, "--max-update", 6, "--max-sentences", 32,
                           "--save-dir", tmp_path / "straight"]])
    assert_ok(straight)
    assert_ok(run_nodes([[*SPARE, "--max-update", 3, "--max-sentences", 32,
                          "--save-dir", tmp_path / "run"]]))
    assert_ok(run_job([*SPARE, "--max-update", 6, "--save-dir", tmp_path / "run", "--zero", 2],
                      [["--max-sentences", 24, "--max-memory-gb", 0.001],
                       ["--max-sentences", 8, "--max-memory-gb", 0.003]]))
    assert max_diff(final_params(tmp_path / "straight"), final_params(tmp_path / "run")) < EXACT
    [a, b] = [torch.load(tmp_path / d / "checkpoint_last.pt", weights_only=True)
              ["controller"]["optimizer"]["state"] for d in ("straight", "run")]
    assert sorted(a) == sorted(b) and len(a) < 4 * 3 + 4           # spares: no state
    assert all(torch.equal(a[i]["momentum_buffer"], b[i]["momentum_buffer"]) or
               (a[i]["momentum_buffer"] - b[i]["momentum_buffer"]).abs().max() < EXACT for i in a)


def test_a_checkpoint_of_another_model_is_refused_by_memory_as_in_every_mode(tmp_path):
    assert_ok(run_nodes([[*BLOCKS, "--max-update", 1, "--max-sentences", 8,
                          "--save-dir", tmp_path]]))
    refused = run_job([*EXACT_SGD, "--toy-blocks", 2, "--max-update", 2, "--save-dir", tmp_path,
                       "--zero", 3, "--state-shares", "memory"],
                      [["--max-sentences", 4], ["--max-sentences", 4]])
    code, out = refused[0]
    assert code == 2 and "2 unexpected key(s), e.g. blocks.2.lin.weight" in out, out[-2000:]


@pytest.mark.parametrize("flags, words", [
    (["--local-steps", 2, "--zero", 1], "--exchange local-steps keeps even shares"),
    (["--compile", "--zero", 3], "--compile traces whole forwards"),
])
def test_what_keeps_even_shares_is_named_under_state_shares_memory(flags, words):
    [(code, out)] = run_nodes([[*EXACT_SGD, "--max-update", 1, "--no-save",
                                "--state-shares", "memory", *flags]])
    assert code == 2 and words in out and "--state-shares even" in out, out[-2000:]
