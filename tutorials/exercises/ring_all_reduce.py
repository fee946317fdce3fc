"""Exercise: the ring all-reduce, from point-to-point sends only.

    python -m minishard.exercise ring_all_reduce

Every rank holds ``tensor`` (1-D, any length, even shorter than the number of ranks). Make it, IN
PLACE, the element-wise SUM of every rank's tensor, using only ``send_recv``:

    send_recv(send, to, recv, frm)   send tensor ``send`` to rank ``to`` WHILE receiving into
                                     tensor ``recv`` (in place, contiguous) from rank ``frm``

The ring: cut the tensor into N chunks, ``tensor.tensor_split(world)`` (views: writing a chunk
writes the tensor; always N of them, some empty when the tensor is short). Every rank sends to
its right neighbour (rank + 1) % N and receives from its left (rank - 1) % N:

    reduce-scatter phase, N-1 steps: send one chunk, ADD the chunk you receive into yours.
                                     After it, rank r holds the full sum of one chunk.
    all-gather phase, N-1 steps:     send a summed chunk, COPY the one you receive.

Which chunk at which step is the whole exercise. The checker also counts your bytes: a ring sends
2(N-1)/N x S per rank (S = the tensor's bytes), the number the comm ledger charges an all_reduce;
and, the inputs being random floats, it checks that every rank ends with the SAME bits, as a real
all-reduce gives them.
Stuck? Tutorial 01 builds one.
"""
import torch


def ring_all_reduce(tensor: torch.Tensor, rank: int, world: int, send_recv) -> None:
    raise NotImplementedError("write the ring: N-1 reduce steps, then N-1 gather steps")
