"""The foundation: the comm ledger's byte counts and RankPool's failure handling."""
import os
import time
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from minishard import comm
from minishard.testing import RankError, RankPool

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------ rank functions
def collectives_match_torch(numel_per_rank: int, dtype_name: str, seed: int):
    """Each comm collective vs the same thing computed from every rank's data, plus the ledger."""
    dtype = DTYPES[dtype_name]
    n, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    data = [torch.randn(n * numel_per_rank, generator=gen).to(dtype) for _ in range(n)]
    mine = data[r]
    total = torch.stack([d.double() for d in data]).sum(0)
    with comm.ledger() as led:
        x = mine.clone(); comm.all_reduce(x, "sum")
        y = mine.clone(); comm.all_reduce(y, "avg")
        z = torch.stack([d.double() for d in data]).max(0).values.to(dtype)
        m = mine.clone(); comm.all_reduce(m, "max")
        shard = torch.empty(numel_per_rank, dtype=dtype)
        comm.reduce_scatter(shard, mine.clone(), "sum")
        in_place = mine.clone()  # the output IS this rank's chunk of the input (FSDP does this)
        own = in_place[r * numel_per_rank:(r + 1) * numel_per_rank]
        comm.reduce_scatter(own, in_place, "sum")
        gathered = torch.empty(n * numel_per_rank, dtype=dtype)
        comm.all_gather(gathered, data[r][:numel_per_rank].clone())
        b = mine.clone(); comm.broadcast(b, src=n - 1)
        h = mine.clone(); handle = comm.all_reduce(h, "avg", async_op=True); handle.wait()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.double(), total, **tol)
    torch.testing.assert_close(y.double(), total / n, **tol)
    torch.testing.assert_close(h.double(), total / n, **tol)
    assert torch.equal(m, z)
    k = numel_per_rank
    torch.testing.assert_close(shard.double(), total[r * k:(r + 1) * k], **tol)
    torch.testing.assert_close(own.double(), total[r * k:(r + 1) * k], **tol)
    assert torch.equal(gathered, torch.cat([d[:k] for d in data]))
    assert torch.equal(b, data[n - 1])
    # the ledger: ring cost model, bytes sent per rank, exact
    S = n * k * torch.empty((), dtype=dtype).element_size()
    expect = [("all_reduce", 2 * S), ("all_reduce", 2 * S), ("all_reduce", 2 * S),
              ("reduce_scatter", S), ("reduce_scatter", S), ("all_gather", S), ("broadcast", S),
              ("all_reduce", 2 * S)]
    assert [(e.op, e.bytes_sent) for e in led.entries] == \
        [(op, Fraction(b * (n - 1), n)) for op, b in expect]
    assert all(e.numel == n * k and e.group_size == n and e.dtype == dtype for e in led.entries)
    return float(led.total_bytes())


def every_all_reduce_algorithm(numel: int, dtype_name: str, op: str, seed: int):
    """Each all_reduce algorithm that runs at this world size, on the whole world and on the
    group of global ranks 1..N-1, against the float64 reduction of every rank's data: the same
    bits on every rank (SyncBatchNorm relies on it), the result within rounding, and the ledger
    charging what that algorithm sends by the textbook (Thakur, Rabenseifner & Gropp 2005)."""
    dtype = DTYPES[dtype_name]
    n, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    data = [torch.randn(numel, generator=gen).to(dtype) for _ in range(n)]
    members = tuple(range(1, n))
    if n > 1 and members not in _groups:  # collective over ALL ranks
        _groups[members] = dist.new_group(list(members))
    out = {}
    groups = [(None, tuple(range(n)))] + ([(_groups[members], members)] if n > 1 else [])
    for group, ranks in groups:
        if r not in ranks:
            continue
        m, S = len(ranks), numel * torch.empty((), dtype=dtype).element_size()
        stacked = torch.stack([data[q].double() for q in ranks])
        want = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.max(0).values}[op]
        # A sum of m values in the input dtype, in any order, errs by at most (m-1)·u·Σ|a|
        # (Higham); the mean's division adds one rounding. The max is exact.
        u = torch.finfo(dtype).eps / 2
        bound = (m * u * stacked.abs().sum(0) / (m if op == "avg" else 1)
                 if op != "max" else torch.zeros_like(want))
        sent = {"ring": Fraction(2 * (m - 1) * S, m), "direct": Fraction((m - 1) * S)}
        if m > 1 and m & (m - 1) == 0:  # at 2 ranks the same message as the exchange
            sent["doubling"] = Fraction(S * (m.bit_length() - 1))
        elif m > 1:  # doubling needs a power of two: refused, before any message
            with pytest.raises(ValueError, match="power-of-two"):
                comm.all_reduce(data[r].clone(), op, group, algorithm="doubling")
        for algorithm in [*sent, "auto"]:
            x = data[r].clone()
            with comm.ledger() as led:
                comm.all_reduce(x, op, group, async_op=True, algorithm=algorithm).wait()
            (e,) = led.entries
            ran = e.algorithm if m > 1 else "ring"
            assert algorithm == "auto" or ran == algorithm or m == 1, (algorithm, e)
            assert e.bytes_sent == (sent[ran] if m > 1 else 0), (algorithm, e)
            assert ((x.double() - want).abs() <= bound).all(), (algorithm, x, want, bound)
            out[(ranks, algorithm)] = (x, ran)
    return out


def test_every_all_reduce_algorithm_gives_every_rank_the_same_bits(pools):
    """And "auto" on a tiny tensor (messages dominate: a positive ALPHA is all it takes) sends
    the fewest messages: doubling at 4 ranks, the direct exchange at 2 and 3."""
    for ws in (1, 2, 3, 4):
        per_rank = pools(ws).run(every_all_reduce_algorithm, 5, "float32", "sum", ws)
        for key, (x, ran) in per_rank[-1].items():
            holders = [res[key][0] for res in per_rank if key in res]
            assert all(torch.equal(h, x) for h in holders), key
            ranks, algorithm = key
            if algorithm == "auto" and len(ranks) > 1:
                assert ran == ("doubling" if len(ranks) == 4 else "direct"), key


@given(ws=st.integers(1, 4), numel=st.integers(1, 40), dtype=st.sampled_from(sorted(DTYPES)),
       op=st.sampled_from(["sum", "avg", "max"]), seed=st.integers(0, 2**16))
def test_all_reduce_algorithms_match_the_float64_reduction(pools, ws, numel, dtype, op, seed):
    per_rank = pools(ws).run(every_all_reduce_algorithm, numel, dtype, op, seed)
    for key, (x, _) in per_rank[-1].items():
        assert all(torch.equal(res[key][0], x) for res in per_rank if key in res), key


_groups: dict = {}


def subgroup_collectives_match(k: int, seed: int):
    """The same on a group of global ranks 1..N-1 (group rank = global rank - 1): minishard's
    gloo paths address peers by GLOBAL rank (broadcasts, the reduce-scatter's sends)."""
    n = dist.get_world_size()
    members = tuple(range(1, n))
    if members not in _groups:  # new_group is collective over ALL ranks, members or not
        _groups[members] = dist.new_group(list(members))
    group = _groups[members]
    if dist.get_rank() not in members:
        return None
    m, gr = len(members), comm.group_rank(group)
    gen = torch.Generator().manual_seed(seed)
    data = [torch.randn(m * k, generator=gen) for _ in range(m)]
    shard = torch.empty(k)
    comm.reduce_scatter(shard, data[gr].clone(), "avg", group)
    gathered = torch.empty(m * k)
    comm.all_gather(gathered, data[gr][:k].clone(), group)
    b = data[gr].clone()
    comm.broadcast(b, src=m - 1, group=group)
    total = torch.stack(data).sum(0)
    torch.testing.assert_close(shard, total[gr * k:(gr + 1) * k] / m)
    assert torch.equal(gathered, torch.cat([d[:k] for d in data]))
    assert torch.equal(b, data[m - 1])
    return gr


def user_p2p_beside_reduce_scatter(k: int):
    """A user's own isend/irecv (tag 0, e.g. pipeline activations) between ranks 0 and 1 while a
    reduce_scatter is in flight, posted in opposite orders on the two ranks: neither message
    may be taken for the other."""
    n, r = dist.get_world_size(), dist.get_rank()
    full = torch.arange(n * k, dtype=torch.float32) + 100 * r
    shard = torch.empty(k)
    mine = torch.full((k,), -1.0) if r == 0 else torch.empty(k)
    if r == 0:
        handle = comm.reduce_scatter(shard, full, "sum", async_op=True)
        user = dist.isend(mine, 1)
    elif r == 1:
        user = dist.irecv(mine, 0)
        handle = comm.reduce_scatter(shard, full, "sum", async_op=True)
    else:
        user, handle = None, comm.reduce_scatter(shard, full, "sum", async_op=True)
    handle.wait()
    if user is not None:
        user.wait()
    want = sum(torch.arange(n * k, dtype=torch.float32)[r * k:(r + 1) * k] + 100 * q
               for q in range(n))
    assert torch.equal(shard, want), (shard, want)
    assert r != 1 or torch.equal(mine, torch.full((k,), -1.0)), mine
    return r


def raise_on(rank_to_fail: int):
    if dist.get_rank() == rank_to_fail:
        raise ValueError(f"deliberate failure on rank {rank_to_fail}")
    t = torch.ones(1)
    dist.all_reduce(t)  # the healthy ranks wait here for the failed one
    return t.item()


def skip_collective_on_rank0():
    if dist.get_rank() != 0:
        t = torch.ones(1)
        dist.all_reduce(t)
    return dist.get_rank()


def whoami():
    return dist.get_rank(), dist.get_world_size(), os.getpid(), torch.get_num_threads()


# ----------------------------------------------------------------------------------- tests
@given(ws=st.integers(1, 4), k=st.integers(1, 9), dtype=st.sampled_from(sorted(DTYPES)),
       seed=st.integers(0, 2**16))
def test_collectives_and_ledger_match_ring_model(pools, ws, k, dtype, seed):
    totals = pools(ws).run(collectives_match_torch, k, dtype, seed)
    assert len(set(totals)) == 1


@given(ws=st.integers(2, 4), k=st.integers(1, 9))
def test_users_point_to_point_messages_do_not_cross_a_reduce_scatter(pools, ws, k):
    assert pools(ws).run(user_p2p_beside_reduce_scatter, k) == list(range(ws))


@given(ws=st.integers(2, 4), k=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_collectives_on_a_subgroup_address_the_right_ranks(pools, ws, k, seed):
    assert pools(ws).run(subgroup_collectives_match, k, seed) == [None, *range(ws - 1)]


def test_pool_returns_rank_ordered_results_and_reuses_ranks(pools):
    pool = pools(3)
    first = pool.run(whoami)
    assert [r for r, *_ in first] == [0, 1, 2] and {w for _, w, *_ in first} == {3}
    assert all(threads == 1 for *_, threads in first)
    assert [pid for _, _, pid, _ in pool.run(whoami)] == [pid for _, _, pid, _ in first]


def test_exception_names_rank_and_carries_traceback(pools):
    pool = pools(2)
    with pytest.raises(RankError, match=r"rank 1 raised: ValueError: deliberate failure on rank 1") as exc:
        pool.run(raise_on, 1)
    assert "Traceback" in exc.value.remote_traceback and exc.value.rank == 1
    assert pool.run(whoami)[1][0] == 1  # the pool still works afterwards


def test_hang_becomes_timeout_and_pool_recovers():
    with RankPool(2, timeout=4) as pool:
        before = [pid for _, _, pid, _ in pool.run(whoami)]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish skip_collective_on_rank0"):
            pool.run(skip_collective_on_rank0)
        assert time.monotonic() - t0 < 15
        after = pool.run(whoami)  # rebuilt with fresh processes
        assert [r for r, *_ in after] == [0, 1]
        assert not set(before) & {pid for _, _, pid, _ in after}
    for pid in before:  # no orphans left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_unpicklable_function_is_refused_clearly(pools):
    with pytest.raises(TypeError, match="module-level function"):
        pools(1).run(lambda: 1)
