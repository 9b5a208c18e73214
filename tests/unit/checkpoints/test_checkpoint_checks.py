"""A checkpoint is checked before it is used (issue 58, item 5): every part a
run loads against what the run builds (hetseq/checkpoints/state.py's kinds), and the
archive against what torch.save writes (hetseq/base/safe_load.py).

The fuzz calls the check in this process on a real checkpoint (a run of
the toy, built once); two train.py runs show the whole path: one line, exit
2, no traceback."""

import copy
import io
import zipfile

import pytest
import torch

from machinery.settings import TOY
from hetseq.base import safe_load
from hetseq.distributed import collectives
from hetseq.base.errors import PeerLost, UserError
from hetseq.checkpoints import files as checkpoint_files


ADAM = [*TOY, "--optimizer", "adam", "--lr", "0.01", "--max-update", "2",
        "--disable-validation"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the Run that saved it, the checkpoint as checkpoint_files.load reads
    it, the file)."""
    from hetseq.app import cli
    from hetseq.distributed.spawn import DistContext
    from hetseq.run.loop import Run
    folder = tmp_path_factory.mktemp("saved")
    args, job, node = cli.parse([*ADAM, "--max-sentences", "10", "--cpu", "--no-progress-bar",
                                 "--save-dir", str(folder)])
    run = Run(args, job, node, DistContext(0, 1, 0, torch.device("cpu")))
    run.train()
    path = folder / "checkpoint_last.pt"
    return run, checkpoint_files.load(str(path)), path


def _nodes(value, path=()):
    """(path, value) of every node of a state, containers too. A list of
    more than 8 items (a generator's 625 words) gives its first two and its
    last: its items share one kind."""
    yield path, value
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
        items = items if len(items) <= 8 else [*items[:2], items[-1]]
    else:
        return
    for key, item in items:
        yield from _nodes(item, (*path, key))


def _wrong(value):
    """{what: the value replaced} for one node: another type, sign, shape, dtype."""
    wrong = {"type": 7 if isinstance(value, str) else "seven"}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        wrong["sign"] = -abs(value) - 1
        wrong["size"] = 10 ** 400      # no float, tensor or str() holds it
    if torch.is_tensor(value):
        wrong["shape"] = torch.zeros(*value.shape, 2, dtype=value.dtype)
        wrong["dtype"] = torch.zeros(value.shape, dtype=torch.bool)
        if value.dim() == 0 and value.is_floating_point():
            wrong["sign"] = -value.abs() - 1
    if isinstance(value, list):
        wrong["shape"] = [*value, 99]
    return wrong


def _replaced(state, path, new):
    state = copy.copy(state)
    node = state
    for key in path[:-1]:     # copies along the path only: the fuzz stays cheap
        node[key] = copy.copy(node[key]) if not isinstance(node[key], tuple) else list(node[key])
        node = node[key]
    node[path[-1]] = new
    return state


# What a run accepts of any sign or content, and why: the flags are kept for
# people to read (only the three that fine-tuning reads are checked); a
# running loss sum and numpy's cached Gaussian may be any float.
FREE = ("meters.loss.sum sign", "meters.grad_norm.sum sign", "rng.0.numpy.4 sign")


def _free(dotted, what):
    if dotted.startswith("args.") and dotted not in ("args.task", "args.config_file", "args.dict"):
        return True
    return f"{dotted} {what}" in FREE


def test_every_wrong_leaf_of_a_real_checkpoint_is_named_in_one_line(trained):
    """Every node of a real checkpoint (the toy, Adam, 2 updates) replaced
    by another type, sign, shape or dtype: the check refuses it with a
    UserError naming that node, on one line, or the node is one whose
    value no run reads with a type in mind (FREE); those, all at once,
    load without an error."""
    run, state, _ = trained
    run.checkpointer.check(state)
    refused, accepted = 0, []
    for path, value in _nodes(state):
        if not path:
            continue
        dotted = ".".join(map(str, path))
        for what, new in _wrong(value).items():
            try:
                run.checkpointer.check(_replaced(state, path, new))
            except UserError as err:
                text = str(err)
                assert type(err) is UserError and "\n" not in text, (dotted, what, text)
                # the node, or the item of it that is wrong (a list grown by one); a
                # model's tensors by their names in the model, as misfits are counted
                named = any(f"{dotted}{end}" in text for end in " .:") or (
                    path[:2] == ("controller", "model") and "controller.model holds 1 " in text
                    and f"e.g. {path[2]}:" in text)
                assert named, (dotted, what, text)
                refused += 1
                continue
            assert _free(dotted, what), f"{dotted} ({what}: {new!r:.60}) was accepted"
            accepted.append((path, new))
    assert refused > 150     # 158 when written: every node the run reads
    for path, new in accepted:
        state = _replaced(state, path, new)
    assert run.checkpointer.restore((0, lambda: state, None)) == "the state of rank 0"


def test_the_fields_of_issue_58_are_named(trained):
    """The issue's own cases: a component that is a string, a negative or
    string count, an optimizer state tensor of another shape."""
    run, state, _ = trained
    cases = [(("controller",), "x"), (("train_iterator",), "x"), (("plan",), "x"),
             (("meters",), "x"), (("rng",), "x"), (("controller", "num_updates"), -3),
             (("controller", "num_updates"), "4"),
             (("controller", "optimizer", "state", 1, "exp_avg"), torch.zeros(3).double())]
    for path, new in cases:
        with pytest.raises(UserError, match=r"does not fit this run: " + ".".join(map(str, path))):
            run.checkpointer.check(_replaced(state, path, new))


def _refused(run, state, words):
    """The check's UserError for ``state``, one line holding ``words``."""
    with pytest.raises(UserError) as err:
        run.checkpointer.check(state)
    assert type(err.value) is UserError
    assert "\n" not in str(err.value) and words in str(err.value), str(err.value)


def test_a_generator_state_of_the_right_shape_that_no_generator_takes_is_named(trained):
    """Zeros of the CPU generator's shape and dtype are no mt19937 state:
    torch.set_rng_state raised after every component had loaded. A CUDA
    state's offset must be a multiple of 4; a host that sees fewer GPUs
    than the saving one takes the states it has room for."""
    from hetseq.run.checkpoint import set_rng_state
    run, state, _ = trained
    zeros = torch.zeros_like(state["rng"][0]["torch"])
    _refused(run, _replaced(state, ("rng", 0, "torch"), zeros),
             "does not fit this run: rng.0.torch is a tensor of shape")
    odd = torch.zeros(16, dtype=torch.uint8)
    odd[8] = 2
    _refused(run, _replaced(state, ("rng", 0, "cuda"), [odd]), "rng.0.cuda.0 is a tensor")
    many = [torch.zeros(16, dtype=torch.uint8)] * (torch.cuda.device_count() + 3)
    run.checkpointer.check(_replaced(state, ("rng", 0, "cuda"), many))
    set_rng_state(_replaced(state, ("rng", 0, "cuda"), many)["rng"][0])


def test_a_sparse_or_expanded_tensor_of_the_right_shape_is_named(trained):
    """An optimizer slot (or a weight) of the right shape and dtype, but
    sparse or expanded (stride 0): the step's views failed on it."""
    run, state, _ = trained
    key = next(iter(state["controller"]["optimizer"]["state"]))
    slot = state["controller"]["optimizer"]["state"][key]["exp_avg"]
    path = ("controller", "optimizer", "state", key, "exp_avg")
    for new in (torch.zeros(1, dtype=slot.dtype).expand(slot.shape),
                torch.zeros(slot.shape, dtype=slot.dtype).to_sparse()):
        _refused(run, _replaced(state, path, new), f"{'.'.join(map(str, path))} is a tensor")
    name = next(n for n, v in state["controller"]["model"].items() if v.dim() == 2)
    weight = state["controller"]["model"][name]
    _refused(run, _replaced(state, ("controller", "model", name),
                            torch.zeros(1, dtype=weight.dtype).expand(weight.shape)),
             f"controller.model.{name} is a tensor")
    run.checkpointer.check(_replaced(state, ("controller", "model", name), weight.t().t()))


def test_param_groups_must_list_this_runs_positions_in_order(trained):
    """torch gives the saved positions to this run's parameters by their
    order in the groups: two swapped (each still once) put one state on a
    parameter of another shape, mid-step."""
    run, state, _ = trained
    params = list(state["controller"]["optimizer"]["param_groups"][0]["params"])
    params[0], params[1] = params[1], params[0]
    _refused(run, _replaced(state, ("controller", "optimizer", "param_groups", 0, "params"),
                            params),
             f"controller.optimizer.param_groups.0.params.0 is position {params[0]}, expected "
             "position 0")


def test_the_file_checked_is_the_file_loaded(tmp_path, monkeypatch):
    """safe_load.load(path) opens the path once: a file renamed onto it
    after the check (here a compressed one) is not what torch.load reads."""
    path = tmp_path / "checkpoint_last.pt"
    path.write_bytes(_saved({"w": torch.zeros(4)}))
    load = torch.load

    def swapped(*args, **kwargs):
        other = tmp_path / "other.pt"
        other.write_bytes(_deflated(_saved({"w": torch.ones(4)})))
        other.replace(path)
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", swapped)
    assert torch.equal(safe_load.load(str(path))["w"], torch.zeros(4))


def _deflated(data):
    """``data`` (torch.save bytes) with every record DEFLATE-compressed:
    what torch.load reads as well, inflating it."""
    source, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for info in source.infolist():
            archive.writestr(info.filename, source.read(info.filename))
    return out.getvalue()


def _listed_twice(data):
    """``data`` with its largest record listed twice in the central
    directory, under another name: read twice from one copy of its bytes."""
    source, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            archive.writestr(info.filename, source.read(info.filename))
        biggest = max(archive.filelist, key=lambda info: info.file_size)
        twin = copy.copy(biggest)
        twin.filename = twin.orig_filename = biggest.filename + "2"
        archive.filelist.append(twin)
    return out.getvalue()


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_only_stored_records_within_the_archive_are_loaded():
    """torch.save writes stored records; torch.load inflates compressed ones
    (64 KB of zeros deflate to a few hundred bytes): refused before
    torch.load, as is a record listed twice, and bytes that are no zip."""
    data = _saved({"w": torch.zeros(16384)})
    assert torch.equal(safe_load.load(data)["w"], torch.zeros(16384))
    deflated = _deflated(data)
    assert len(deflated) < len(data) // 20
    assert torch.equal(torch.load(io.BytesIO(deflated), weights_only=True)["w"], torch.zeros(16384))
    with pytest.raises(safe_load.Unsafe, match="is compressed"):
        safe_load.load(deflated)
    with pytest.raises(safe_load.Unsafe, match="overlap"):
        safe_load.load(_listed_twice(data))
    with pytest.raises(safe_load.Unsafe, match="not a zip archive"):
        safe_load.load(data[:len(data) // 2])


def test_a_compressed_checkpoint_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    path.write_bytes(_deflated(_saved({"format": checkpoint_files.FORMAT})))
    with pytest.raises(UserError, match=f"checkpoint {path} cannot be read \\(its record .* is "
                                        "compressed"):
        checkpoint_files.load(str(path))


def test_a_peers_compressed_object_is_refused_naming_the_peer():
    """What all_gather_object and broadcast_from decode (collectives.py)."""
    data = _deflated(_saved({"state": torch.zeros(100)}))
    with pytest.raises(PeerLost, match="rank 3 sent an object that is not what torch.save writes"):
        collectives._decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), 3)
    plain = torch.frombuffer(bytearray(_saved([1, "two"])), dtype=torch.uint8)
    assert collectives._decode(plain, 3) == [1, "two"]


def test_a_declared_kind_is_checked_wherever_a_file_is_read(tmp_path):
    """An elastic node reads the update count of its own file, fine-tuning
    the flags: a file whose count is a string is refused when read."""
    import hetseq.checkpoints.keys  # noqa: F401  (declares the count's kind)
    path = tmp_path / "checkpoint_last.pt"
    checkpoint_files.save(str(path), {"format": checkpoint_files.FORMAT,
                                      "controller": {"num_updates": "many"}})
    with pytest.raises(UserError, match="controller.num_updates is the string 'many', expected "
                                        "an int >= 0"):
        checkpoint_files.load(str(path))
