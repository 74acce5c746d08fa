"""``ReplayTrainPipeline``: the DLRM example's model trained through it equals the same model trained eagerly on the
same batches, through a learning-rate change, a checkpoint round trip, a batch of another size mid-run and a
short last batch. On CPUs the graph's step runs eagerly on the static batch (no CUDA graphs): the pipeline's
batch flow, refills, eager fallbacks, its dense gradients' average and optimizer step; the GPU twin replays (NCCL
with a GPU a rank: the average inside the graph; ranks sharing a GPU over gloo: after it)."""

import os
import re
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import (OwnerBackward, PgasCapacityError, PgasError, PgasTrainingConfig, ReplayTrainPipeline,
                           StaticKJT, copy_kjt_)
from torchrec_pgas.testing import local_state, rank_device, run_distributed
from torchrec_pgas.static_kjt import FeatureGroup
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE
from torchrec_pgas.train_pipeline import batch_signature, copy_batch_, signature_difference, step_unless

WORLD = int(os.environ.get("PGAS_TEST_WORLD", "2"))


def kjt(lengths: List[int], weighted: bool = False) -> KeyedJaggedTensor:
    n = sum(lengths)
    return KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(n), lengths=torch.tensor(lengths),
                             weights=torch.rand(n) if weighted else None)


def batch(lengths: List[int], rows: int = 2, weighted: bool = False) -> Batch:
    return Batch(dense_features=torch.rand(rows, 3), sparse_features=kjt(lengths, weighted),
                 labels=torch.rand(rows))


def test_a_batch_fits_the_captured_one_by_shapes_and_counts_per_key() -> None:
    captured = batch_signature(batch([1, 2, 3, 1]))

    def difference(b: Batch) -> str:
        found = signature_difference(captured, batch_signature(b))
        return "" if found is None else found[1]

    assert signature_difference(captured, batch_signature(batch([3, 0, 2, 2]))) is None  # bags vary within a key
    assert difference(batch([1, 2, 4, 1])) == "batch.sparse_features.ids['b']: 5 (the captured batch: 4)"
    assert difference(batch([1, 1], rows=1)).startswith(
        "batch.dense_features: shape (1, 3), torch.float32 (the captured batch: shape (2, 3)")
    assert difference(batch([1, 2, 3, 1], weighted=True)) == (
        "batch.sparse_features.weights: weighted (the captured batch: unweighted)")


def test_copy_batch_refills_every_tensor_of_the_static_batch() -> None:
    static, new = batch([1, 2, 3, 1], weighted=True), batch([2, 1, 1, 3], weighted=True)
    copy_batch_(static, new)
    for mine, theirs in ((static.dense_features, new.dense_features), (static.labels, new.labels),
                         (static.sparse_features.values(), new.sparse_features.values()),
                         (static.sparse_features.lengths(), new.sparse_features.lengths()),
                         (static.sparse_features.weights(), new.sparse_features.weights())):
        assert torch.equal(mine, theirs)


def test_a_static_kjt_takes_any_id_counts_up_to_its_capacity() -> None:
    static = StaticKJT.at_capacity(kjt([1, 2, 3, 1], weighted=True), capacity=12)
    for lengths in ([3, 0, 2, 2], [5, 4, 2, 1], [0, 0, 0, 0]):
        batch_kjt = kjt(lengths, weighted=True)
        copy_kjt_(static, batch_kjt)
        n = sum(lengths)
        assert static.values().numel() == 12 and static.count == n
        assert torch.equal(static.values()[:n], batch_kjt.values()) and torch.equal(static.offsets(), batch_kjt.offsets())
        plain = static.unpadded()
        assert plain.length_per_key() == batch_kjt.length_per_key()
        assert torch.equal(plain.weights(), batch_kjt.weights()) and torch.equal(plain.values(), batch_kjt.values())
    assert static.split([2]) == [static]
    with pytest.raises(PgasError, match="no per-key sizes"):  # none on the host: a replay's would be stale
        static.length_per_key()
    with pytest.raises(PgasError, match=r"split into \[1, 1\] features is not its shardings' \(\[\[0, 1\]\]\)"):
        static.split([1, 1])
    before = static.values().clone()
    with pytest.raises(PgasCapacityError, match=r"a batch of 13 ids \(feature 'a': 7 of them\) exceeds .* 12 ids"):
        copy_kjt_(static, kjt([6, 1, 3, 3], weighted=True))  # before anything is copied
    assert torch.equal(static.values(), before) and static.capacity_error() is None
    static.fill_(kjt([6, 1, 3, 3], weighted=True), past_capacity=True)  # what a replay then refuses
    assert static.offsets()[-1] == 13 and "13 ids" in str(static.capacity_error())
    with pytest.raises(PgasError, match="batch size 1"):
        copy_kjt_(static, kjt([1, 1], weighted=True))
    with pytest.raises(PgasError, match="no weights"):
        copy_kjt_(static, kjt([1, 1, 1, 1]))


def test_a_static_kjt_is_permuted_and_split_by_sharding_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """An EBC of several PGAS shardings permutes its static KJT by sharding and splits it (TorchRec's
    ``input_dist``): each part equals the plain KJT's, its ids first and zeros after them, at its sharding's
    capacity, with no tensor made from host values after ``at_capacity`` (a capture could not take one); a batch
    past one sharding's capacity keeps its offsets whole, its part's ids cut (the step refuses it on the device)
    and is named by ``capacity_error``; one past the whole capacity gives the other parts zeros where their ids
    were cut, never another feature's ids."""
    keys, rows = ["a", "b", "c", "d", "e"], 3
    groups = (FeatureGroup((3, 0), 14), FeatureGroup((4,), 6), FeatureGroup((1, 2), 12))
    gen = torch.Generator().manual_seed(0)

    def batch_kjt(lengths: torch.Tensor) -> KeyedJaggedTensor:
        n = int(lengths.sum())
        return KeyedJaggedTensor(keys=keys, values=torch.randint(1, 100, (n,), generator=gen), lengths=lengths,
                                 weights=torch.rand(n, generator=gen))

    with pytest.raises(PgasError, match="do not hold each of the batch's 5 keys once"):
        StaticKJT.at_capacity(batch_kjt(torch.ones(5 * rows, dtype=torch.int64)), groups[:2])
    static = StaticKJT.at_capacity(batch_kjt(torch.ones(5 * rows, dtype=torch.int64)), groups)
    assert static.capacity == 32
    for trial in range(21):
        lengths = torch.randint(0, 3, (5 * rows,), generator=gen)
        if trial >= 19:  # 7 ids of 'e': past its sharding's 6; then 33 or more of 'a': past the whole capacity too
            lengths[12:] = torch.as_tensor([2, 2, 3])
            lengths[:3] += 11 * (trial == 20)
        plain = batch_kjt(lengths)
        static.fill_(plain, past_capacity=True)
        order = [3, 0, 4, 1, 2]
        with monkeypatch.context() as patched:
            patched.setattr(torch, "tensor", None)  # at_capacity made every index tensor permute and split use
            parts = static.permute(order).split([2, 1, 2])
        expected = plain.permute(order).split([2, 1, 2])
        for part, want, group in zip(parts, expected, groups):
            n, fits = sum(want.length_per_key()), sum(want.length_per_key()) <= group.capacity
            assert part.keys() == want.keys() and part.counts == want.length_per_key()
            assert part.capacity == group.capacity and torch.equal(part.offsets(), want.offsets())
            kept = min(n, group.capacity)
            if trial < 20:
                assert torch.equal(part.values()[:kept], want.values()[:kept])
                assert torch.equal(part.weights()[:kept], want.weights()[:kept])
            elif group.features == (1, 2):  # it fits, but its ids lie past the whole capacity: cut, never others'
                assert fits and not part.values().any() and part.offsets()[-1] == n
            assert fits or trial >= 19
            assert not part.values()[kept:].any() and not part.weights()[kept:].any()
        error = static.capacity_error()
        assert (error is None) == (trial < 19)
        assert trial != 19 or re.search(r"feature 'e': 7 of them\) exceeds the capacity of the PGAS sharding that "
                                        r"reads 'e': 7 ids of its 1 features, over its 6", str(error))
    with pytest.raises(PgasError, match="does not give each feature to one sharding"):
        static.permute([3, 0, 4, 1, 1])


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad"])
def test_a_refused_dense_step_is_put_back(optimizer: str) -> None:
    """``step_unless``: with ``refused`` False, the optimizer's own step, bit for bit; with True, the parameters and
    the optimizer state as before it (a refused step's dense update, undone on the device in a replay)."""
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1)}[optimizer]
    torch.manual_seed(0)
    gated, plain = (torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)) for _ in "ab")
    plain.load_state_dict(gated.state_dict())
    opts = [make(m.parameters()) for m in (gated, plain)]

    def grads(seed: int) -> None:
        for m in (gated, plain):
            torch.manual_seed(seed)
            m(torch.randn(5, 4)).sum().backward()

    for i in range(3):
        grads(i)
        step_unless(opts[0], torch.tensor([False]))
        opts[1].step()
        for o in opts:
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(gated.parameters(), plain.parameters()))
    grads(9)
    step_unless(opts[0], torch.tensor([True]))
    assert all(torch.equal(a, b) for a, b in zip(gated.parameters(), plain.parameters()))
    mine, theirs = (o.state_dict()["state"] for o in opts)
    assert all(torch.equal(torch.as_tensor(mine[k][n]), torch.as_tensor(theirs[k][n])) for k in theirs for n in theirs[k])


def _dense(dmp: Any) -> List[torch.nn.Parameter]:
    """The parameters the dense optimizer steps (the tables' optimizer runs in their backward)."""
    return [p for p in dmp.parameters() if not hasattr(p, "_in_backward_optimizers")]


def _set_lr(dmp: Any, dense_opt: torch.optim.Optimizer, lr: float) -> None:
    for group in dmp.fused_optimizer.param_groups:
        group["lr"] = lr
    dmp.fused_optimizer.step()  # the tables take a changed rate here, as in eager training
    for group in dense_opt.param_groups:
        group["lr"] = lr


def _past_capacity(b: Batch, ids_per_bag: int) -> Batch:
    """``b`` with ``ids_per_bag + 1`` ids in every bag (row 0: every table has it): past the capacity the DLRM
    example sizes for ``ids_per_bag``."""
    kjt = b.sparse_features
    lengths = torch.full_like(kjt.lengths(), ids_per_bag + 1)
    ids = torch.zeros(int(lengths.sum()), dtype=kjt.values().dtype)
    return Batch(dense_features=b.dense_features, labels=b.labels,
                 sparse_features=KeyedJaggedTensor(keys=kjt.keys(), values=ids, lengths=lengths, stride=kjt.stride()))


def _with_bad_id(b: Batch) -> Batch:
    """``b`` with its first id past every table: a step the model refuses."""
    kjt = b.sparse_features
    ids = kjt.values().clone()
    ids[0] = 10 ** 9
    return Batch(dense_features=b.dense_features, labels=b.labels,
                 sparse_features=KeyedJaggedTensor(keys=kjt.keys(), values=ids, lengths=kjt.lengths(), stride=kjt.stride()))


Fed = List[Tuple[str, Batch]]  # (kind, batch): train, eval, junk (trained, then undone), over or bad (refused)


def _feed(pipeline: ReplayTrainPipeline, piped: Any, dense_opt: torch.optim.Optimizer, fed: Fed,
          root: str) -> Tuple[Dict[int, float], List[torch.Tensor], List[Tuple[int, str, str]]]:
    """Every batch of ``fed`` through the pipeline: the lr changes after training step 10, the caller drops the dense
    gradients after step 5, a checkpoint is saved after step 25 and loaded after the second junk batch. Returns the
    loss of each training step that returned one (by its index), each call's labels, and the errors raised (call,
    type, message): a refused replay raises at a later call (after training that call's batch), a refused eager
    step at its own."""
    it, losses, labels, raised, trained, junk = iter(b for _, b in fed), {}, [], [], 0, 0
    for i, (kind, b) in enumerate(fed):
        piped.train(kind != "eval")
        trained += kind == "train"
        junk += kind == "junk"
        try:
            loss, _, step_labels = pipeline.progress(it)
            labels.append(step_labels)
            if kind == "train":
                losses[trained] = float(loss)
        except PgasError as e:
            raised.append((i, type(e).__name__, str(e)))
            labels.append(b.labels)
        if kind == "train" and trained == 5:
            dense_opt.zero_grad(set_to_none=True)
        if kind == "train" and trained == 10:
            _set_lr(piped, dense_opt, 0.2)
        if kind == "train" and trained == 25:
            dcp.save({"model": piped.state_dict()}, checkpoint_id=os.path.join(root, "ckpt"))
        if kind == "junk" and junk == 2:  # the junk steps undone
            state = {"model": piped.state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(root, "ckpt"))
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    return losses, labels, raised


def _pipeline_against_eager(rank: int, world: int, device_type: str, root: str, ids_per_bag: int, plan: str) -> Tuple[
        float, float, float, bool, int, bool, List[Tuple[int, str, str]]]:
    """The DLRM example's model (features of 1 to ``ids_per_bag`` ids a bag) through the pipeline and through a
    plain eager loop, on the same 30 training batches (``_feed``): an eval batch (forward only) after step 12; a
    batch past the ids capacity on every rank after step 2 (on GPUs, the call that captures) and after step 7, and
    one with a bad id on the last rank after step 16 (refused: not trained by the eager loop); step 21 has another
    batch size, the last one is a short batch (both eager). ``plan``: "pgas" (every table PGAS row-wise), or
    "mixed" (every third table PGAS table-wise: the EBC permutes and splits its static KJT by sharding). Returns the largest loss difference over the training steps, the table state difference, the dense
    parameter difference, whether the pipeline captured its step, the batches it trained off the graph's step,
    whether every step's output kept its own batch's labels, and the errors raised."""
    from examples.dlrm.data import SyntheticCriteo
    from examples.dlrm.run import build_model, shard

    device = rank_device(rank, device_type) if device_type == "cuda" else torch.device("cpu")
    training = PgasTrainingConfig(owner_backward=OwnerBackward.PGAS)
    types = {f"t_cat_{i}": PGAS_TABLE_WISE if i % 3 == 0 else PGAS_ROW_WISE for i in range(26)}
    piped, eager = (shard(build_model(16, 2000, device, seed=0), "auto" if plan == "mixed" else plan, device, 32,
                          training, lr=0.5, types=types if plan == "mixed" else None, ids_per_bag=ids_per_bag)
                    for _ in "ab")
    optimizers = [torch.optim.SGD(_dense(m), lr=0.5) for m in (piped, eager)]

    def draw(kind: str, size: int, n: int, seed: int) -> Fed:
        return [(kind, b) for b in SyntheticCriteo(size, n, 2000, seed=seed + rank, max_ids_per_bag=ids_per_bag)]

    main = draw("train", 32, 28, 100)
    over = [("over", _past_capacity(b, ids_per_bag)) for _, b in draw("over", 32, 2, 600)]
    bad = [("bad", _with_bad_id(b) if rank == world - 1 else b) for _, b in draw("bad", 32, 1, 700)]
    fed = (main[:2] + over[:1] + main[2:7] + over[1:] + main[7:12] + draw("eval", 32, 1, 500) + main[12:16] + bad
           + main[16:20] + draw("train", 16, 1, 200) + main[20:24] + draw("junk", 32, 2, 300) + main[24:]
           + draw("train", 8, 1, 400))
    pipeline: ReplayTrainPipeline[Batch, Any] = ReplayTrainPipeline(piped, optimizers[0], device)
    losses, labels, raised = _feed(pipeline, piped, optimizers[0], fed, root)
    reference = []
    for b in [b for kind, b in fed if kind == "train"]:
        loss, _ = eager(b.to(device))
        loss.backward()
        optimizers[1].step()
        optimizers[1].zero_grad()
        reference.append(float(loss))
        if len(reference) == 10:
            _set_lr(eager, optimizers[1], 0.2)
    dense = max(float((a - b).abs().max()) for a, b in zip(_dense(piped), _dense(eager)))
    tables = max(float((a - b).abs().max()) for a, b in zip(local_state(piped).values(), local_state(eager).values()))
    dist.barrier()
    kept_labels = all(torch.equal(out.cpu(), b.labels) for out, (_, b) in zip(labels, fed))
    return (max(abs(loss - reference[k - 1]) for k, loss in losses.items()), tables, dense, pipeline.captured,
            pipeline.batches_off_graph, kept_labels, raised)


def _check_against_eager(results: List[Any], captured: bool, ids_per_bag: int) -> None:
    world = len(results)
    for rank, (worst_loss, tables, dense, was_captured, off_graph, kept_labels, raised) in enumerate(results):
        # off the graph's step: the odd-sized batch and the short one; multi-hot batches replay (a StaticKJT)
        assert was_captured == captured and off_graph == 2 and kept_labels
        assert worst_loss <= 1e-6 and tables <= 1e-6 and dense <= 1e-6, (rank, worst_loss, tables, dense)
        over, bad = raised[:2], raised[2:]
        for (call, kind, message), at in zip(over, (2, 8)):
            assert call == at and kind == "PgasCapacityError" and re.search(
                rf"a batch of {32 * 26 * (ids_per_bag + 1)} ids \(feature 'cat_\d+': {32 * (ids_per_bag + 1)} of "
                r"them\) exceeds", message), (rank, raised)
        # the bad id's step (call 19): raised there by an eager step, at one of the next two calls by a replay
        expected = "PgasInputError" if rank == world - 1 else "PgasPeerAbortError"
        assert len(bad) == 1 and 19 <= bad[0][0] <= 21 and bad[0][1] == expected, (rank, raised)


PLANS = [(1, "pgas"), (4, "pgas"), (4, "mixed")]  # (the most ids a bag, the plan: ``_pipeline_against_eager``)


@pytest.mark.stacks  # TorchRec's TrainPipeline base and DMP's DDP wrapper, as each stack has them
@pytest.mark.parametrize(("ids_per_bag", "plan"), PLANS)
def test_the_pipeline_trains_as_the_eager_loop(tmp_path: Any, ids_per_bag: int, plan: str) -> None:
    _check_against_eager(run_distributed(_pipeline_against_eager, 2, "cpu", str(tmp_path), ids_per_bag, plan),
                         captured=False, ids_per_bag=ids_per_bag)


@pytest.mark.gpu
@pytest.mark.peers
@pytest.mark.parametrize(("ids_per_bag", "plan"), PLANS)
def test_the_pipeline_replays_as_the_eager_loop_on_gpus(tmp_path: Any, ids_per_bag: int, plan: str) -> None:
    _check_against_eager(run_distributed(_pipeline_against_eager, max(WORLD, 2), "cuda", str(tmp_path), ids_per_bag,
                                         plan, device_type="cuda"), captured=True, ids_per_bag=ids_per_bag)
