"""Tutorial 01: the four collectives, and what each one costs.

    torchrun --standalone --nproc_per_node=2 tutorials/01_collectives.py
    torchrun --standalone --nproc_per_node=4 tutorials/01_collectives.py

Everything in data-parallel training (DDP, SyncBatchNorm, ZeRO 1/2/3) is built from four
collective operations. Every rank calls the same one, with tensors of the same size, and each
rank's tensor changes:

    all_reduce      every rank ends with the SUM (or mean, or max) of every rank's tensor
    all_gather      every rank ends with the CONCATENATION of every rank's piece, in rank order
    reduce_scatter  rank r ends with piece r of the SUM of every rank's tensor
    broadcast       every rank ends with the tensor of one rank (the source)

In minishard every collective goes through ONE module, ``minishard.comm``: that is the only place
where ranks talk to each other, so it is the only place a reader has to look, and the only place
that needs to count bytes. Inside ``with minishard.ledger() as led:`` every collective this rank
issues is written down with the bytes it sends under the ring cost model (S = bytes of the full
tensor, N = ranks)::

    all_reduce      2 (N-1)/N * S        all_gather, reduce_scatter, broadcast    (N-1)/N * S

This script runs each collective on tiny tensors and prints what every rank holds before and after
(gathered to rank 0, so the lines come out in order), shows that reduce_scatter followed by
all_gather IS an all_reduce, and then derives the cost model: it builds a ring all-reduce from
point-to-point sends, counts the bytes it really hands to the network, and asserts that they equal
the ledger's formula. Every printed claim is asserted.
"""
from fractions import Fraction

import torch
import torch.distributed as dist

import minishard
from minishard import comm


def show(label: str, tensor: torch.Tensor, rank: int, world: int) -> None:
    """Print every rank's ``tensor`` on rank 0, one line per rank, in rank order.

    Output from several processes interleaves unpredictably, so we collect the values first, with
    an all_gather (the tensor has the same shape on every rank, as every collective requires)."""
    everyone = torch.empty(world * tensor.numel(), dtype=tensor.dtype)
    comm.all_gather(everyone, tensor.reshape(-1).contiguous(), tag="tutorial: printing")
    if rank == 0:
        for r, row in enumerate(everyone.view(world, -1)):
            values = " ".join(f"{v:g}" for v in row.tolist())
            print(f"   {label:<7} rank {r}: shape {tuple(tensor.shape)}  [{values}]")


def ring_all_reduce(tensor: torch.Tensor, rank: int, world: int) -> int:
    """All-reduce (sum) ``tensor`` in place with the ring algorithm, from point-to-point messages
    only. Returns the number of bytes this rank sent.

    Cut the tensor into N chunks. Every rank sends to its right neighbour and receives from its
    left, N-1 times to reduce, N-1 times to share:

      reduce-scatter phase, step s:  send chunk (r - s), receive chunk (r - s - 1) and ADD it in.
                                     After N-1 steps rank r holds the full sum of chunk (r + 1).
      all-gather phase, step s:      send chunk (r + 1 - s), receive chunk (r - s) and COPY it.
                                     After N-1 steps every rank holds every summed chunk.

    Each step sends one chunk of S/N bytes: 2 (N-1) steps x S/N = 2 (N-1)/N * S per rank. That is
    where the ledger's formula comes from, and why it barely grows with N (it tends to 2 S): the
    ring is bandwidth-optimal. (This demo uses point-to-point calls on purpose; everything else in
    minishard uses the collectives in comm.py, which gloo and NCCL implement with rings or trees.)
    """
    chunks = list(tensor.chunk(world))  # views: writing a chunk writes the tensor
    right, left = (rank + 1) % world, (rank - 1) % world
    sent = 0
    for phase in ("reduce", "gather"):
        for s in range(world - 1):
            out_i = (rank - s) % world if phase == "reduce" else (rank + 1 - s) % world
            in_i = (rank - s - 1) % world if phase == "reduce" else (rank - s) % world
            incoming = torch.empty_like(chunks[in_i])
            # Send and receive at the same time: a blocking send first would deadlock the ring.
            send = dist.isend(chunks[out_i].contiguous(), right)
            dist.recv(incoming, left)
            send.wait()
            sent += chunks[out_i].numel() * chunks[out_i].element_size()
            if phase == "reduce":
                chunks[in_i] += incoming
            else:
                chunks[in_i].copy_(incoming)
    return sent


def main(rank: int, world: int) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} ranks. Every tensor below is float32; rank r's values depend on r.\n")

    # ------------------------------------------------------------------------- 1. all_reduce
    say("1. all_reduce(sum): every rank gets the element-wise sum over ranks")
    x = torch.arange(3.0) + 10 * rank                  # rank r: [10r, 10r+1, 10r+2]
    show("before", x, rank, world)
    comm.all_reduce(x, "sum")                           # in place
    show("after", x, rank, world)
    # Σ_r (i + 10 r) = N i + 10 N(N-1)/2, whatever the rank: the same tensor everywhere.
    assert torch.equal(x, world * torch.arange(3.0) + 10 * world * (world - 1) / 2)
    y = torch.arange(3.0) + 10 * rank
    comm.all_reduce(y, "avg")                           # "avg" = the sum divided by N
    assert torch.equal(y, x / world)
    say(f"   with op='avg' every rank gets the sum / {world}: {y.tolist()}\n")

    # ------------------------------------------------------------------------- 2. all_gather
    say("2. all_gather: every rank gets all the pieces, concatenated in rank order")
    piece = torch.tensor([rank + 0.1, rank + 0.2])      # 2 elements per rank
    full = torch.empty(world * piece.numel())           # the output holds N pieces
    show("before", piece, rank, world)
    comm.all_gather(full, piece)
    show("after", full, rank, world)
    assert torch.equal(full, torch.cat([torch.tensor([r + 0.1, r + 0.2]) for r in range(world)]))
    say("")

    # --------------------------------------------------------------------- 3. reduce_scatter
    say("3. reduce_scatter(sum): rank r gets piece r of the sum")
    full = torch.arange(2.0 * world) + 100 * rank       # every rank: N pieces of 2
    mine = torch.empty(2)
    show("before", full, rank, world)
    comm.reduce_scatter(mine, full)
    show("after", mine, rank, world)
    total = world * torch.arange(2.0 * world) + 100 * world * (world - 1) / 2
    assert torch.equal(mine, total[2 * rank:2 * rank + 2])
    say("")

    # -------------------------------------------------------------------------- 4. broadcast
    say("4. broadcast(src=0): every rank gets rank 0's tensor")
    b = torch.tensor([3.0, 1.0, 4.0]) if rank == 0 else torch.zeros(3)
    show("before", b, rank, world)
    comm.broadcast(b, src=0)
    show("after", b, rank, world)
    assert torch.equal(b, torch.tensor([3.0, 1.0, 4.0]))
    say("")

    # ------------------------------------------- 5. reduce_scatter + all_gather == all_reduce
    # Each rank keeps its piece of the sum, then everyone collects everyone's piece: the whole sum.
    # This is the identity ZeRO lives on: stage 0 all-reduces gradients; stages 1-3 stop halfway
    # (reduce-scatter: each rank keeps only the slice of the gradient it updates) and do the
    # all-gather later, on the updated PARAMETERS instead.
    # Integer values, so the sums are exact in any order: with arbitrary floats the two ways add
    # in different orders and may differ in the last bit (float addition is not associative).
    k = 5
    g = torch.randint(-50, 50, (world * k,), generator=torch.Generator().manual_seed(rank)).float()
    with minishard.ledger() as via_all_reduce:
        summed = g.clone()
        comm.all_reduce(summed)
    with minishard.ledger() as via_two_halves:
        piece = torch.empty(k)
        comm.reduce_scatter(piece, g)
        rebuilt = torch.empty(world * k)
        comm.all_gather(rebuilt, piece)
    assert torch.equal(rebuilt, summed)
    assert via_two_halves.total_bytes() == via_all_reduce.total_bytes()
    say("5. reduce_scatter, then all_gather of the pieces == all_reduce (asserted: equal tensors,")
    sent_each = float(via_two_halves.total_bytes())
    say(f"   and the same bytes sent per rank either way: {sent_each:g})\n")

    # ----------------------------------------------------------------- 6. the ring cost model
    S_numel = 1024 * world                # 4 KiB per rank of float32, divisible into N chunks
    S = S_numel * 4                       # bytes of the full tensor
    expected = {"all_reduce": Fraction(2 * (world - 1), world) * S,
                "all_gather": Fraction(world - 1, world) * S,
                "reduce_scatter": Fraction(world - 1, world) * S,
                "broadcast": Fraction(world - 1, world) * S}
    with minishard.ledger() as led:
        comm.all_reduce(torch.ones(S_numel), tag="demo")
        comm.all_gather(torch.empty(S_numel), torch.ones(S_numel // world), tag="demo")
        comm.reduce_scatter(torch.empty(S_numel // world), torch.ones(S_numel), tag="demo")
        comm.broadcast(torch.ones(S_numel), src=0, tag="demo")
    say(f"6. What each rank sends for a full tensor of S = {S} bytes on N = {world} ranks "
        "(the ledger on this rank):")
    say("   " + led.table().replace("\n", "\n   "))
    for entry in led.entries:
        assert entry.bytes_sent == expected[entry.op], (entry, expected[entry.op])
        assert entry.numel == S_numel and entry.group_size == world
    say(f"   all_reduce: 2(N-1)/N * S = {float(expected['all_reduce']):g}; the others: "
        f"(N-1)/N * S = {float(expected['all_gather']):g} (asserted for every row)")

    # Where the formula comes from: the ring, built from sends and receives, counting real bytes.
    data = torch.randint(-50, 50, (S_numel,), generator=torch.Generator().manual_seed(rank)).float()
    by_ring = data.clone()
    sent = ring_all_reduce(by_ring, rank, world)
    by_comm = data.clone()
    comm.all_reduce(by_comm)
    assert torch.equal(by_ring, by_comm)          # the ring computes an all_reduce...
    assert sent == expected["all_reduce"]         # ...and sends exactly what the ledger charges
    say(f"   A ring all-reduce built from point-to-point sends gives the same sum and sent {sent} "
        f"bytes\n   from this rank = 2 x {world - 1} steps x S/{world}: the ledger's number "
        "(asserted).")
    # The bytes per rank hardly grow with N: 2(N-1)/N * S is S at N=2 and tends to 2S. Adding
    # ranks costs latency (2(N-1) steps), not bandwidth per rank.
    # ------------------------------------------------------- 7. latency: the alpha-beta model
    # Bytes are not the whole cost. Every message pays a fixed latency ALPHA (the call, the
    # wake-up of the peer, the loopback), every byte sent BETA:  time = messages*ALPHA +
    # bytes*BETA. The ring sends the fewest bytes, 2(N-1)/N * S, but in 2(N-1) messages. A direct
    # exchange (every rank sends its whole tensor to every other, then each adds the N tensors in
    # rank order) sends N-1 messages of S bytes. Recursive doubling (N a power of two: swap the
    # running sum with rank r XOR 1, then r XOR 2, ...) sends log2 N messages of S bytes. For a
    # tensor of a few KiB (SyncBatchNorm's statistics) the messages are everything, so the fewest
    # win; for MiBs (ZeRO's buckets) the ring. ALPHA and BETA were measured on this machine
    # (python bench/alpha_beta.py, see costs.py).
    alpha, beta = comm.ALPHA, comm.BETA
    small = torch.full((129,), float(rank), dtype=torch.float64)  # 2C+1 statistics, C = 64
    with minishard.ledger() as led:
        comm.all_reduce(small, algorithm="auto", tag="demo: small")
    (entry,) = led.entries
    nbytes = small.numel() * 8
    doubling = world > 2 and world & (world - 1) == 0  # a power of two (at 2: the exchange)
    fewest = "ring" if world == 1 else "doubling" if doubling else "direct"
    messages = {"ring": 2 * (world - 1), "direct": world - 1, "doubling": world.bit_length() - 1}
    assert entry.algorithm == fewest, entry
    # what it really sends: each of its messages carries the whole tensor
    assert entry.bytes_sent == (0 if world == 1 else messages[fewest] * nbytes)
    assert torch.equal(small, torch.full((129,), world * (world - 1) / 2, dtype=torch.float64))
    say(f"7. Latency. Measured here: ALPHA = {1e6 * alpha:.0f} us per message, BETA = "
        f"{1e9 * beta:.2f} ns per byte.")
    say(f"   {nbytes} bytes on {world} ranks, by the model: " + ", ".join(
        f"{a} {messages[a]} messages = {1e6 * comm.all_reduce_cost(a, nbytes, world):.0f} us"
        for a in comm.all_reduce_algorithms(world)))
    say(f"   comm.all_reduce(algorithm='auto') ran '{entry.algorithm}', sending "
        f"{float(entry.bytes_sent):g} bytes (the ledger records what it ran; asserted).")
    if world > 2:  # at 2 ranks the exchange sends S once, like the ring: it always wins
        # Against the fewest-messages algorithm the ring saves bytes: it wins above the size
        # where its extra messages cost less than the bytes it saves. (At N = 4, against
        # doubling: 4 messages more, S/2 bytes fewer, so S* = 8 ALPHA/BETA.)
        extra, copies = messages["ring"] - messages[fewest], messages[fewest]
        crossover = extra * alpha / ((copies - 2 * (world - 1) / world) * beta)
        big = torch.ones(int(2 * crossover) // 4 + 1)      # twice the crossover: the ring wins
        with minishard.ledger() as led:
            comm.all_reduce(big, algorithm="auto", tag="demo: big")
        assert led.entries[0].algorithm == "ring"
        say(f"   The ring wins above S* = {extra} x ALPHA / (({copies} - 2(N-1)/N) x BETA)"
            f" = {crossover / 1024:.0f} KiB; a {big.numel() * 4 / 1024:.0f} KiB tensor gets it "
            "(asserted).")
    elif world == 2:
        say("   With 2 ranks both send S bytes and the exchange saves a message: it always wins.")
    say("\nAll assertions held.")


if __name__ == "__main__":
    # Set-up and tear-down, the same for every lesson (see minishard/launch.py): a gloo process
    # group with a timeout, and a clean exit.
    with minishard.launch.session() as (rank, world):
        main(rank, world)
