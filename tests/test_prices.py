"""The planner's price of one backend call (observe/predict.py: ``price``) against the ring's
arithmetic written out here, not read from costs.py: per rank, a ring all-reduce sends
2(N-1)/N of the tensor in 2(N-1) messages (a reduce-scatter pass, then an all-gather pass), an
all-gather (N-1)/N in N-1 messages; a send, the whole tensor in one."""
import pytest

from minishard import comm
from minishard.observe.predict import price

MIB = 1 << 20


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_ring_all_reduce_costs_twice_an_all_gather(n):
    a, b = comm.ALPHA, comm.BETA
    assert price("allreduce", MIB, n) == pytest.approx(2 * (n - 1) * a + 2 * (n - 1) / n * MIB * b)
    assert price("allgather", MIB, n) == pytest.approx((n - 1) * a + (n - 1) / n * MIB * b)
    assert price("send", MIB, n) == pytest.approx(a + MIB * b)
