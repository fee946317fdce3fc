"""The estimator (``python -m minishard.plan``): its CLI output, its byte parser, and its numbers
against two oracles:

  * the ZeRO paper's Figure 1 (7.5B parameters, 64 ranks, mixed-precision Adam, K = 12):
    120 GB, 31.4 GB, 16.6 GB and 1.88 GB per rank for stages 0-3 (7.5e9 x 16 bytes = 120e9;
    stage 3 divides all of it by 64: 1.875e9);
  * the engine's MEASURED memory report: a small fp32 Adam model trained at stages 0-3 on warm
    ranks, whose tensors' storage must hold exactly the bytes the estimator predicts. Every flat
    buffer's numel is divisible by the world size, so there is no padding to account for.

Rank functions are module-level (RankPool pickles them by reference).
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import minishard
from minishard.plan import estimate, main, min_ranks, parse_bytes


def run_cli(capsys, *argv: str) -> str:
    main(list(argv))
    return capsys.readouterr().out


def table_rows(out: str) -> dict[int, list[str]]:
    """{stage: [params, grads, optimizer, total, left, fits]} from the printed table."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^([0-3])\s+(.*)$", line)
        if m:
            cells = re.findall(r"-?[0-9.,]+ [kMGT]?B|yes|no", m.group(2))
            rows[int(m.group(1))] = cells
    return rows


# ---------------------------------------------------------------------------- the paper's case
def test_paper_figure_1_numbers(capsys):
    out = run_cli(capsys, "--params", "7.5e9", "--ranks", "64", "--memory", "80GB",
                  "--mixed-precision")
    rows = table_rows(out)
    assert [rows[s][3] for s in range(4)] == ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"], out
    assert [rows[s][5] for s in range(4)] == ["no", "yes", "yes", "yes"], out
    # stage 0: 2 + 2 + 12 bytes per parameter, nothing divided by 64
    assert rows[0][:3] == ["15 GB", "15 GB", "90 GB"], out
    assert "K, with the fp32 master copy" in out and "NOT counted" in out
    assert "Recommendation: stage 1" in out
    exact = [r["total"] for r in estimate(7.5e9, 64, 80e9, "adam", mixed_precision=True)]
    assert exact == pytest.approx([120e9, 31.40625e9, 16.640625e9, 1.875e9], rel=1e-12)


def test_recommendations(capsys):
    small = run_cli(capsys, "--params", "1e9", "--ranks", "8", "--memory", "80GB",
                    "--mixed-precision")
    assert "Recommendation: stage 0" in small
    assert "plain DDP (stage 0) is simplest and fastest" in small.replace("\n", " ")
    mid = run_cli(capsys, "--params", "7e9", "--ranks", "8", "--memory", "80GB",
                  "--mixed-precision")
    assert table_rows(mid)[0][3] == "112 GB" and table_rows(mid)[1][3] == "38.5 GB"
    assert "Recommendation: stage 1" in mid
    big = run_cli(capsys, "--params", "70e9", "--ranks", "8", "--memory", "80GB",
                  "--mixed-precision")
    assert [r[5] for r in table_rows(big).values()] == ["no"] * 4
    assert "nothing fits on 8 ranks" in big and "at least 14 ranks" in big   # 16 x 70e9 / 80e9
    sgd = run_cli(capsys, "--params", "1e9", "--ranks", "8", "--memory", "24G", "--optimizer",
                  "sgd")
    assert table_rows(sgd)[0][:4] == ["4 GB", "4 GB", "4 GB", "12 GB"]     # fp32 SGD: 4+4+4


@pytest.mark.parametrize("text, value", [
    ("80GB", 80e9), ("80GiB", 80 * 2**30), ("24G", 24e9), ("24Gi", 24 * 2**30),
    ("512MiB", 2**29), ("1000", 1000), ("1.5e10", 1.5e10), ("2tb", 2e12), (" 3 kB ", 3000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GB", "80 gigs", "1e", "-5GB", "80GBB"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_bad_memory_is_a_clear_cli_error(capsys):
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--ranks", "8", "--memory", "80 gigs"])
    assert "cannot read '80 gigs' as a size" in capsys.readouterr().err


@given(params=st.floats(1e6, 1e12), memory=st.floats(1e9, 1e11), stage=st.sampled_from(range(4)),
       mp=st.booleans())
def test_min_ranks_is_the_fewest_that_fit(params, memory, stage, mp):
    n = min_ranks(params, memory, stage, "adam", mp)
    fits = lambda ranks: estimate(params, ranks, memory, "adam", mp)[stage]["fits"]  # noqa: E731
    if n is None:  # the unsharded terms alone exceed the memory: no number of ranks helps
        assert not fits(10**9)
    else:
        assert fits(n) and (n == 1 or not fits(n - 1))


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "minishard.plan", "--params", "7.5e9", "--ranks",
                           "64", "--memory", "80GB", "--mixed-precision"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert table_rows(proc.stdout)[3][3] == "1.88 GB"


# ------------------------------------------------------- the estimator vs the measured engine
WIDTH, BLOCKS = 16, 3  # Linear(16, 16): 272 parameters per block, divisible by 2 and by 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def measured_memory() -> list[dict[str, int]]:
    """On each rank, for stages 0-3: fp32 Adam; one step creates Adam's state, then the report is
    taken after the next backward, when params, grads and optimizer state are all alive."""
    return [measured_memory_at(stage) for stage in range(4)]


def measured_memory_at(stage: int) -> dict[str, int]:
    torch.manual_seed(0)
    model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=stage,
                           units={Block})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, WIDTH)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    return model.memory_report(opt)


@pytest.mark.parametrize("world", [2, 4])
def test_estimator_equals_measured_memory(pools, world):
    psi = BLOCKS * (WIDTH * WIDTH + WIDTH)
    predicted = estimate(psi, world, memory=math.inf, optimizer="adam", mixed_precision=False)
    per_rank = pools(world).run(measured_memory)
    for stage in range(4):
        want = predicted[stage]
        for rank, rep in enumerate(r[stage] for r in per_rank):
            # Stage 1 frees its full gradients at the end of backward; the estimator counts them
            # as the paper does, and the engine's peak of full gradients is that number.
            grads = rep["peak_full_grads"] if stage == 1 else rep["grads"]
            got = {"params": rep["params"], "grads": grads, "optimizer": rep["optimizer"]}
            assert got == {k: want[k] for k in got}, (stage, rank, rep, want)
            assert sum(got.values()) == want["total"]
