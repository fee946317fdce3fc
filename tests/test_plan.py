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
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import minishard
from minishard.observe.memory import (activation_bytes, activation_bytes_per_layer, fmt_decimal,
                                      step_bytes, zero_bytes)
from minishard.observe.plan import (choices, estimate, main, min_ranks, parse_bytes, parse_count,
                                    parse_headroom)


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
# The ZeRO paper's Table 1 (Rajbhandari et al. 2020, arXiv:1910.02054): GB a device holds in
# model states, mixed-precision Adam (K = 12), as printed there, for Pos / Pos+g / Pos+g+p.
TABLE_1 = {
    7.5e9: {1: "120 120 120", 4: "52.5 41.3 30", 16: "35.6 21.6 7.5", 64: "31.4 16.6 1.88",
            256: "30.4 15.4 0.47", 1024: "30.1 15.1 0.12"},
    128e9: {1: "2048 2048 2048", 4: "896 704 512", 16: "608 368 128", 64: "536 284 32",
            256: "518 263 8", 1024: "513 257 2"},
    1e12: {1: "16000 16000 16000", 4: "7000 5500 4000", 16: "4750 2875 1000",
           64: "4187 2218 250", 256: "4046 2054 62.5", 1024: "4011 2013 15.6"},
}


def as_the_paper_prints(gb: float) -> str:
    """The table's printing: from 100 GB the whole GB (4187.5 -> 4187), below that one decimal
    (two below 10), half up (41.25 -> 41.3), trailing zeros dropped (7.50 -> 7.5)."""
    if gb >= 100:
        return str(math.floor(gb))
    places = Decimal(10) ** -(1 if gb >= 10 else 2)
    return format(Decimal(gb).quantize(places, ROUND_HALF_UP).normalize(), "f")


def test_paper_table_1_every_cell():
    for psi, rows in TABLE_1.items():
        for ranks, printed in rows.items():
            cells = [sum(zero_bytes(psi, ranks, stage, "adam", mixed_precision=True).values())
                     for stage in (1, 2, 3)]
            assert " ".join(as_the_paper_prints(b / 1e9) for b in cells) == printed, (psi, ranks)


def test_paper_figure_1_numbers(capsys):
    out = run_cli(capsys, "--params", "7.5e9", "--ranks", "64", "--memory", "80GB",
                  "--mixed-precision")
    rows = table_rows(out)
    assert [rows[s][3] for s in range(4)] == ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"], out
    assert [rows[s][5] for s in range(4)] == ["no", "yes", "yes", "yes"], out
    # stage 0: 2 + 2 + 12 bytes per parameter, nothing divided by 64
    assert rows[0][:3] == ["15 GB", "15 GB", "90 GB"], out
    assert "fp32 master params + fp32 exp_avg + exp_avg_sq" in out and "NOT counted" in out
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
                  "--mixed-precision", "--headroom", "0")
    assert [r[5] for r in table_rows(big).values()] == ["no"] * 4
    assert "nothing fits on 8 ranks" in big and "at least 14 ranks" in big   # 16 x 70e9 / 80e9
    # with the default 10% headroom, 72 GB usable: 16 x 70e9 / 72e9 = 15.6 -> 16 ranks
    assert "at least 16 ranks" in run_cli(capsys, "--params", "70B", "--ranks", "8", "--memory",
                                          "80GB", "--mixed-precision")
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
       mp=st.booleans(), whole=st.sampled_from([0.0, 1e-3, 0.1]))
def test_min_ranks_is_the_fewest_that_fit(params, memory, stage, mp, whole):
    replicated = whole * params  # kept whole on every rank (persist_below)
    n = min_ranks(params, memory, stage, "adam", mp, replicated)
    fits = lambda ranks: estimate(params, ranks, memory, "adam", mp,  # noqa: E731
                                  replicated=replicated)[stage]["fits"]
    if n is None:  # the unsharded terms alone exceed the memory: no number of ranks helps
        assert not fits(10**9)
    else:
        assert fits(n) and (n == 1 or not fits(n - 1))


def test_replicated_parameters_count_whole_in_every_term():
    # the ZeRO paper's Figure 1 model at stage 3 (1.88 GB a rank) with 1e8 of its 7.5e9
    # parameters kept whole: 16 bytes each on every rank, the rest still cut 64 ways
    row = estimate(7.5e9, 64, 80e9, "adam", mixed_precision=True, replicated=1e8)[3]
    assert row["total"] == pytest.approx(16 * 1e8 + 16 * 7.4e9 / 64)
    out = subprocess.run([sys.executable, "-m", "minishard.plan", "--params", "7.5e9", "--ranks",
                          "64", "--memory", "80GB", "--mixed-precision", "--replicated", "100M"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    assert "3.45 GB" in out and "kept whole on every rank" in out


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "minishard.plan", "--params", "7.5e9", "--ranks",
                           "64", "--memory", "80GB", "--mixed-precision"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert table_rows(proc.stdout)[3][3] == "1.88 GB"


def test_check_outside_torchrun_says_how_to_start_it():
    """--check predicts and measures ranks: without torchrun it runs nothing and says so, in one
    line whose command is the whole one (--check and --model included)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "minishard.plan", "--check", "--model", "gpt"],
                          capture_output=True, text=True, timeout=120,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr  # launch.WRONG_WORLD_SIZE
    assert proc.stderr.count("\n") == 1 and "start it with torchrun, e.g. torchrun --standalone " \
        "--nproc_per_node=2 -m minishard.plan --check --model gpt" in proc.stderr, proc.stderr


# ------------------------------------------------------------- parameter counts and headroom
@pytest.mark.parametrize("text, value", [
    ("7B", 7e9), ("70b", 70e9), ("1.3e9", 1.3e9), ("1.3B", 1.3e9), ("350M", 350e6),
    ("125m", 125e6), ("1.5T", 1.5e12), ("7000000000", 7e9), (" 13 B ", 13e9)])
def test_parse_count(text, value):
    assert parse_count(text) == pytest.approx(value, rel=1e-15)


@pytest.mark.parametrize("text", ["", "B", "7 billion", "7GB", "-7B", "7BB"])
def test_parse_count_refuses(text):
    with pytest.raises(ValueError):
        parse_count(text)


def test_headroom_is_a_percentage_or_a_size():
    assert parse_headroom("10%", 80e9) == pytest.approx(8e9)
    assert parse_headroom("2GB", 80e9) == 2e9
    with pytest.raises(ValueError):
        parse_headroom("100%", 80e9)


def test_help_prints_the_assumptions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "(default 10%)" in out and "Korthikanti" in out


def test_cli_accepts_7B_and_refuses_nonsense(capsys):
    out = run_cli(capsys, "--params", "7B", "--ranks", "8", "--memory", "80GB",
                  "--mixed-precision")
    assert table_rows(out)[0][3] == "112 GB"                        # 16 bytes x 7e9
    base = ["--ranks", "8", "--memory", "80GB"]
    for argv in (["--params", "7 billion", *base], ["--params", "7B", "--headroom", "120%", *base],
                 ["--params", "7B", "--layers", "2", *base],
                 ["--params", "7B", "--checkpointing", *base]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "error:" in capsys.readouterr().err


# ------------------------------------------------------------------------------- activations
def paper_itemisation(s: int, b: int, h: int, a: int) -> int:
    """Korthikanti et al. 2022, section 4.1: what one layer stores, item by item (16-bit
    values, 1-byte dropout masks). Written out here, not taken from minishard.observe.memory."""
    attention = (2 * s * b * h          # QKV projection input
                 + 4 * s * b * h        # Q and K, for QK^T
                 + 2 * a * s * s * b    # softmax output
                 + a * s * s * b        # softmax dropout mask
                 + 2 * a * s * s * b    # dropout output, for attention over V
                 + 2 * s * b * h        # V
                 + 2 * s * b * h        # output projection input
                 + s * b * h)           # attention dropout mask
    mlp = 2 * s * b * h + 8 * s * b * h + 8 * s * b * h + s * b * h  # fc1, GeLU, fc2 in; mask
    layernorms = 2 * (2 * s * b * h)
    return attention + mlp + layernorms


# The paper's evaluated configurations (its Table 3; sequence 2048, micro-batch 1): name, heads,
# hidden, layers. Per layer, sbh(34 + 5as/h) bytes; e.g. GPT-3 175B: 2048 x 12288 x (34 + 80).
PAPER_MODELS = [("22B", 64, 6144, 48), ("175B", 96, 12288, 96), ("530B", 128, 20480, 105),
                ("1T", 160, 25600, 128)]


@pytest.mark.parametrize("name, a, h, layers", PAPER_MODELS)
def test_activations_match_the_paper(name, a, h, layers):
    s, b = 2048, 1
    per_layer = activation_bytes_per_layer(s, b, h, a)
    # sbh(34 + 5as/h) = 34sbh + 5as²b, in integers
    assert per_layer == 34 * s * b * h + 5 * a * s * s * b == paper_itemisation(s, b, h, a)
    assert activation_bytes(layers, s, b, h, a) == layers * per_layer
    # full recomputation: each layer keeps its 2sbh input; one layer is rebuilt at a time
    assert activation_bytes_per_layer(s, b, h, a, checkpointing=True) == 2 * s * b * h
    assert activation_bytes(layers, s, b, h, a, checkpointing=True) == \
        layers * 2 * s * b * h + per_layer
    if name == "175B":
        assert per_layer == 2_868_903_936                   # 2048 * 12288 * 114, by hand


@given(s=st.integers(1, 4096), b=st.integers(1, 16), h=st.integers(1, 4096).map(lambda x: 8 * x),
       a=st.sampled_from([1, 2, 4, 8]))
def test_activation_formula_is_the_itemisation(s, b, h, a):
    assert activation_bytes_per_layer(s, b, h, a) == paper_itemisation(s, b, h, a)
    # fp32 activations (our derivation): every 2-byte item doubles, the masks stay 1 byte
    masks = 2 * s * b * h + a * s * s * b
    assert activation_bytes_per_layer(s, b, h, a, element_bytes=4) == \
        2 * (paper_itemisation(s, b, h, a) - masks) + masks


def test_worked_examples():
    """Two worked examples of the same formula published elsewhere: 8192 x 8192 x (34 + 320) =
    23.8 GB per layer (h = s = 8192, 64 heads, b = 1), and BERT-base, 128 tokens, 12 layers:
    51,904,512 bytes."""
    assert fmt_gb(activation_bytes_per_layer(8192, 1, 8192, 64)) == "23.8"
    assert activation_bytes(12, 128, 1, 768, 12) == 51_904_512


def fmt_gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


SHAPE_1_3B = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "2048",
              "--micro-batch", "4"]


def test_the_issue_case_says_what_is_left_for_activations(capsys):
    """1.3B on 4 x 24 GB: states alone leave 3.2 GB at stage 0, of which the default 10%
    headroom (2.4 GB) keeps 2.4 GB: 800 MB left for activations, and the recommendation says so.
    With the shape counted, 45.9 GB of activations fit nowhere; checkpointed, stage 1 fits."""
    plain = run_cli(capsys, "--params", "1.3B", "--ranks", "4", "--memory", "24GB",
                    "--mixed-precision").replace("\n", " ")
    assert "headroom kept free: 2.4 GB" in plain
    assert "Recommendation: stage 0; it leaves 800 MB per rank for activations" in plain
    acts = activation_bytes(24, 2048, 4, 2048, 16)
    assert fmt_gb(acts) == "45.9"
    full = run_cli(capsys, "--params", "1.3B", "--ranks", "4", "--memory", "24GB",
                   "--mixed-precision", *SHAPE_1_3B)
    assert [r[6] for r in table_rows(full).values()] == ["no"] * 4
    assert "--checkpointing" in full.split("Recommendation")[1]
    ckpt = run_cli(capsys, "--params", "1.3B", "--ranks", "4", "--memory", "24GB",
                   "--mixed-precision", *SHAPE_1_3B, "--checkpointing")
    rows = table_rows(ckpt)
    assert [r[6] for r in rows.values()] == ["no", "yes", "yes", "yes"]
    assert "Recommendation: stage 1" in ckpt
    left_1 = 21.6e9 - 9.1e9 - activation_bytes(24, 2048, 4, 2048, 16, checkpointing=True)
    assert rows[1][5] == f"{left_1 / 1e9:.3g} GB" and rows[1][4] == "2.72 GB"


@given(params=st.floats(1e6, 1e11), ranks=st.integers(1, 64), memory=st.floats(1e9, 1e11),
       headroom=st.floats(0, 0.5), acts=st.floats(0, 5e10), mp=st.booleans())
def test_fits_means_states_plus_activations_within_memory_less_headroom(params, ranks, memory,
                                                                        headroom, acts, mp):
    rows = estimate(params, ranks, memory, "adam", mp, headroom * memory, acts)
    for row in rows:
        states = row["params"] + row["grads"] + row["optimizer"]
        assert row["fits"] == (states + acts <= memory * (1 - headroom) * (1 + 1e-12)) or \
            abs(states + acts - memory * (1 - headroom)) < 1e-3 * memory


# ----------------------------------------------------------------------------- several nodes
@given(psi=st.integers(1, 10**12), nodes=st.integers(1, 16), per_node=st.integers(1, 16),
       mp=st.booleans())
def test_multi_node_bytes_are_the_formulas(psi, nodes, per_node, mp):
    b = 2 if mp else 4
    n = nodes * per_node
    rows = {r["choice"]: r for r in choices(psi, nodes, per_node, 80e9, "adam", mp)}
    full = {0: 2 * psi * b * Fraction(n - 1, n), 1: 2 * psi * b * Fraction(n - 1, n),
            2: 2 * psi * b * Fraction(n - 1, n), 3: 3 * psi * b * Fraction(n - 1, n)}
    for stage, name in enumerate(["DDP (stage 0)", "stage 1", "stage 2", "stage 3"]):
        crossing = full[stage] if nodes > 1 else 0    # one ring through every rank
        assert rows[name]["cross"] == pytest.approx(float(crossing), rel=1e-12, abs=0)
        assert rows[name]["intra"] == pytest.approx(float(full[stage] - crossing), rel=1e-12)
    cross = 2 * Fraction(psi, per_node) * b * Fraction(nodes - 1, nodes)
    for stage in (1, 2, 3):  # the stage inside the node, the gradient shard all-reduced across
        hybrid = rows[f"hybrid stage {stage}"]
        intra = (3 if stage == 3 else 2) * psi * b * Fraction(per_node - 1, per_node)
        assert hybrid["intra"] == pytest.approx(float(intra), rel=1e-12, abs=0)
        assert hybrid["cross"] == pytest.approx(float(cross), rel=1e-12, abs=0)
    # memory: stage 3 over the S ranks of a node, 16 bytes per parameter (either precision)
    assert rows["hybrid stage 3"]["states"] == pytest.approx(16 * psi / per_node, rel=1e-12)
    assert rows["stage 3"]["states"] == pytest.approx(16 * psi / n, rel=1e-12)


def test_multi_node_cli_recommends_hybrid_when_it_fits(capsys):
    out = run_cli(capsys, "--params", "7B", "--nodes", "2", "--ranks-per-node", "4", "--memory",
                  "80GB")
    table = {line[:16].strip(): line[16:].split() for line in out.splitlines()
             if line.startswith(("DDP", "stage ", "hybrid"))}
    # 7e9 fp32 params, N = 8: stage 0 2Ψb(N-1)/N = 49 GB, stage 3 73.5 GB, all across nodes;
    # hybrid 3Ψb(3/4) = 63 GB in the node + 2(Ψ/4)b(1/2) = 7 GB across; hybrid stages 1-2
    # 2Ψb(3/4) = 42 GB in the node, the same 7 GB across
    assert table["DDP (stage 0)"][4:8] == ["0", "B", "49", "GB"]
    assert table["stage 3"][4:8] == ["0", "B", "73.5", "GB"]
    assert table["hybrid stage 3"][4:8] == ["63", "GB", "7", "GB"]
    assert table["hybrid stage 1"][4:8] == table["hybrid stage 2"][4:8] == ["42", "GB", "7", "GB"]
    # hybrid stage 1 holds (4 + 4)Ψ + 8Ψ/4 = 70 GB <= 72 GB usable: it fits, and ties hybrid
    # stages 2-3 across nodes with fewer bytes in all: the --nodes rule picks it, and says so
    assert table["hybrid stage 1"][:2] == ["70", "GB"] and table["hybrid stage 1"][-1] == "yes"
    assert "Recommendation: hybrid stage 1" in out
    assert "Rule with --nodes: of the choices that fit, the FEWEST BYTES ACROSS NODES" in \
        out.replace("\n", " ")
    one = run_cli(capsys, "--params", "7B", "--nodes", "1", "--ranks-per-node", "8", "--memory",
                  "80GB")
    assert "Recommendation: stage 1, the lowest stage that fits" in one.replace("\n", " ")
    with pytest.raises(SystemExit):
        main(["--params", "7B", "--nodes", "2", "--memory", "80GB"])
    assert "--nodes and --ranks-per-node go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--params", "7B", "--nodes", "2", "--ranks-per-node", "4", "--ranks", "6",
              "--memory", "80GB"])
    assert "give one or the other" in capsys.readouterr().err


# ------------------------------------------------- the printed formulas vs the printed numbers
def printed_value(cell: str) -> float:
    """'38.5 GB' -> 38.5e9, '-230 GB' -> -2.3e11, '0 B' -> 0 (decimal units, as printed)."""
    number, unit = cell.replace(",", "").split()
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit]


def run_printed(formula: str, **names: float) -> float:
    """Evaluates a formula exactly as printed ('·' is a product), with the printed names."""
    assert re.fullmatch(r"[\w\s·+\-*/().Ψ]+", formula), formula
    return eval(formula.replace("·", "*").replace("Ψ", "psi"), {}, names)  # noqa: S307


def close(a: float, b: float) -> bool:
    """Equal to the 3 significant digits the table prints."""
    return abs(a - b) <= 0.006 * max(abs(a), abs(b)) + 0.5


@pytest.mark.parametrize("argv", [
    ["--params", "7B", "--ranks", "8", "--memory", "80GB"],
    ["--params", "7B", "--ranks", "8", "--memory", "80GB", "--mixed-precision"],
    ["--params", "1.3B", "--ranks", "4", "--memory", "24GB", "--optimizer", "sgd", *SHAPE_1_3B],
    ["--params", "1.3B", "--ranks", "4", "--memory", "24GB", "--mixed-precision", *SHAPE_1_3B,
     "--checkpointing"],
    ["--params", "70B", "--nodes", "4", "--ranks-per-node", "8", "--memory", "80GB",
     "--mixed-precision"]])
def test_printed_formulas_compute_the_printed_numbers(capsys, argv):
    """Reads the header as a learner would: the bytes per parameter, Ψ, N, the model-state and
    activation formulas (and the multi-node ones); runs each formula on those printed values and
    finds the printed table's numbers. A label that drifts from what is computed fails here."""
    out = run_cli(capsys, *argv)
    flat = " ".join(out.split())
    p, g, k = (float(re.search(rf"{name} = ([0-9.]+) \(", flat).group(1)) for name in "pgK")
    psi = float(re.search(r"Ψ = ([0-9,]+)", flat).group(1).replace(",", ""))
    n = int(re.search(r", N = (\d+):", flat).group(1))
    rows = table_rows(out)
    for stage in range(4):
        formula = re.search(rf"stage {stage} ([^;]+?)[;.] ", flat).group(1)
        states = run_printed(formula, p=p, g=g, K=k, psi=psi, N=n)
        assert close(states, printed_value(rows[stage][3])), (stage, formula, rows[stage])
    if "--layers" in argv:
        m = re.search(r"\): (L·.+?) without checkpointing, (L·.+?) with full activation "
                      r"checkpointing, for L=(\d+) layers, s=(\d+), b=(\d+), h=(\d+), a=(\d+)",
                      flat)
        dims = dict(zip("Lsbha", map(int, m.groups()[2:])))
        used = m.group(2) if "--checkpointing" in argv else m.group(1)
        acts = run_printed(used, **dims)
        assert all(close(acts, printed_value(r[4])) for r in rows.values()), (used, rows)
        # the activation formula for the dtype the header names: 16-bit with mixed precision
        bits = "16-bit" if "--mixed-precision" in argv else "32-bit"
        assert f"{bits} activations" in flat
    if "--nodes" in argv:
        s, r = int(argv[argv.index("--ranks-per-node") + 1]), int(argv[argv.index("--nodes") + 1])
        b = float(re.search(r"b = (\d)-byte", flat).group(1))
        table = {line[:16].strip(): line[16:].split() for line in out.splitlines()
                 if line.startswith(("DDP", "stage ", "hybrid"))}
        names = dict(psi=psi, b=b, N=n, S=s, R=r)
        for label, choices in (("stages 0-2 over all N", ["DDP (stage 0)", "stage 1", "stage 2"]),
                               ("stage 3 over all N", ["stage 3"]),
                               ("hybrid stages 1-2", ["hybrid stage 1", "hybrid stage 2"]),
                               ("hybrid stage 3", ["hybrid stage 3"])):
            text = re.search(rf"{label}: ([^;]+?)[;.] ", flat).group(1)
            inside = re.search(r"in node ([^,]+)", text)
            across = re.search(r"across (\S+)", text).group(1)
            for choice in choices:
                cells = table[choice]
                got_in, got_across = (printed_value(" ".join(cells[i:i + 2])) for i in (4, 6))
                assert close(run_printed(across, **names), got_across), (choice, text, cells)
                assert close(run_printed(inside.group(1), **names) if inside else 0, got_in), \
                    (choice, text, cells)


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


def measured_step_bytes() -> list[int]:
    """Bytes the ledger records on this rank for one whole iteration (forward, backward, step)
    after a warm-up iteration, at stages 0-3. Stages 1-2 re-gather the stepped shards in the
    next forward, so a steady iteration holds one reduce-scatter and one all-gather."""
    out = []
    for stage in range(4):
        torch.manual_seed(0)
        model = minishard.ZeRO(nn.Sequential(*[Block() for _ in range(BLOCKS)]), stage=stage,
                               units={Block})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, WIDTH)
        for _ in range(2):  # the ledger of the second iteration is kept
            with minishard.ledger() as led:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        out.append(led.total_bytes())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_step_bytes_equal_the_ledger(pools, world):
    psi = BLOCKS * (WIDTH * WIDTH + WIDTH)  # no padding at 2 or 4 ranks
    for rank, per_stage in enumerate(pools(world).run(measured_step_bytes)):
        assert per_stage == [step_bytes(psi, stage, world, 4) for stage in range(4)], rank


# ------------------------------------------------- selective recomputation, a GPU on paper
@given(s=st.integers(1, 4096), b=st.integers(1, 16), h=st.integers(1, 4096).map(lambda x: 8 * x),
       a=st.sampled_from([1, 2, 4, 8]), layers=st.integers(1, 96))
def test_selective_recomputation_keeps_the_itemisation_but_the_scores(s, b, h, a, layers):
    """The paper's selective recomputation (its Table 2: 34sbh a layer): every item of the
    itemisation but the three a·s²·b ones (softmax output, its dropout mask, dropout output)."""
    scores = 2 * a * s * s * b + a * s * s * b + 2 * a * s * s * b
    assert activation_bytes(layers, s, b, h, a, checkpointing="selective") == \
        layers * (paper_itemisation(s, b, h, a) - scores) == layers * 34 * s * b * h


def test_flops_a_token_are_nanogpts_and_torchtitans():
    """6N + 12·L·H·Q·T, as nanoGPT's estimate_mfu writes it (N its non-embedding count: the tied
    wte/lm_head counted once) and torchtitan's get_num_flop_per_token (N without the untied
    input embedding). Written out here, from each one's own terms."""
    from minishard.observe.on_paper import flops_per_token
    n_gpt2 = 124_337_664 - 1024 * 768  # GPT-2 124M less its position embedding
    assert flops_per_token(n_gpt2, 12, 768, 1024) == 6 * n_gpt2 + 12 * 12 * 12 * 64 * 1024
    llama = 8_030_261_248  # Llama 3.1 8B; its input embedding 128,256 x 4,096 is untied
    assert flops_per_token(llama, 32, 4096, 8192, vocab=128_256) == \
        6 * (llama - 128_256 * 4096) + 12 * 32 * 32 * 128 * 8192


LLAMA_8B = ["--params", "8030261248", "--ranks", "8", "--memory", "96GB", "--mixed-precision",
            "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "8192",
            "--micro-batch", "2", "--checkpointing", "selective"]
ON_PAPER = ["--tflops", "989", "--efficiency", "0.4", "--link", "450GB", "--vocab", "128256"]


def test_the_time_on_paper_is_its_printed_assumptions(capsys):
    """The table's times from the printed assumptions: compute = s·b x FLOPs a token over
    TFLOPS x efficiency; communication = the stage's bytes (3Ψ·2·(N-1)/N at stage 3, bf16) over
    the link; the step the longer (hidden) or the sum (exposed); tokens/s = s·b / step."""
    out = run_cli(capsys, *LLAMA_8B, *ON_PAPER)
    flat = " ".join(out.split())
    per_token = float(re.search(r"Time on paper: ([0-9.]+) GFLOPs a token", flat).group(1)) * 1e9
    tokens = 8192 * 2
    compute = tokens * per_token / (989e12 * 0.4)
    rows = {int(line.split()[0]): line.split() for line in out.split("Time on paper")[1]
            .splitlines() if re.match(r"^[0-3] ", line)}
    for stage, sent in ((0, 2), (3, 3)):
        talk = sent * 8030261248 * 2 * 7 / 8 / 450e9
        cells = rows[stage]  # stage, compute, comm, hidden, /, exposed, tokens hidden, /, exposed
        assert float(cells[1]) == pytest.approx(compute, abs=1e-3), cells
        assert float(cells[2]) == pytest.approx(talk, abs=1e-3), cells
        assert float(cells[3]) == pytest.approx(max(compute, talk), abs=1e-3)
        assert float(cells[5]) == pytest.approx(compute + talk, abs=1e-3)
        assert float(cells[6].replace(",", "")) == pytest.approx(tokens / max(compute, talk),
                                                                 abs=1)
    # the memory beside it: 16Ψ/8 of model states and 34sbh a layer, selective, at stage 3
    assert table_rows(out.split("Time on paper")[0])[3][4] == fmt_decimal(32 * 34 * 8192 * 2 * 4096)
    assert "Counted: selective" in flat


@pytest.mark.parametrize("argv, says", [
    (LLAMA_8B[:7] + ON_PAPER, "with the transformer shape"),
    (LLAMA_8B + ON_PAPER[:4], "--tflops, --efficiency and --link together"),
    (LLAMA_8B + ["--tflops", "989", "--efficiency", "40", "--link", "450GB"], "(0, 1]"),
    (["--timeline", "3", "--ranks", "0"], "--ranks 0: give a number of ranks, 1 or more"),
    (["--timeline", "3", "--ranks", "-2"], "--ranks -2: give a number of ranks, 1 or more"),
    (["--params", "7B", "--ranks", "-2", "--memory", "80GB"], "--ranks must be positive")])
def test_a_wrong_option_is_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and says in err, err
    assert err.startswith("python -m minishard.plan: error: ") and "Traceback" not in err
