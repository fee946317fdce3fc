"""A/B: the same benchmark on a git ref and on the working tree, alternately, in one invocation.

    python bench/ab.py REF [--rounds 3] [--nproc 2] [--band 0.03] [-- ARGS for the benchmark]
    python bench/ab.py 0de9e67 -- --model gpt --systems "minishard stage 3"

REF's ``minishard/`` package is laid out in a temporary folder (``git archive``); the working
tree's ``bench/zero_vs_stock.py`` (``--script`` to choose another that writes ``--json``) then
runs once on each tree per round, with ``PYTHONPATH`` pointing at that tree, in the order
old, new, new, old, old, new, ... (so a trend in the machine's speed over the run falls on both
sides alike). Each run is a whole torchrun job: the same model, data and interleaved steps.

For each system it prints new/old of the median step time per round, and a verdict:

    slower / faster        EVERY round's ratio is above 1 + band / below 1 - band
    no real difference     the rounds disagree, or stay within the band

Then each system runs alone in a fresh job on each tree (``--only``, 5 steps), and its peak
resident memory growth is printed beside the times (``--no-memory`` skips it): an A/B shows
both.

The stock systems (torch DDP, FSDP, the floor) run the same code on both sides: their ratios
are the control, and show how far two runs of identical code drift apart here. A control that
reads "slower" or "faster" says the machine changed speed during the run: measure again.

Why whole steps, alternated: on 2 cores compute and gloo's threads compete, so a collective that
is faster alone can make the step slower (bench/RESULTS.md, issue 24). Only whole steps count.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def lay_out(ref: str, into: Path) -> str:
    """``REF``'s minishard package under ``into``; returns the full commit id."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "minishard"], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def run_once(tree: Path, script: Path, nproc: int, args: list[str], out: Path) -> dict:
    """One torchrun job of ``script`` importing minishard from ``tree``; its --json results."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), "--json", str(out), *args]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    used = Path(result["minishard"]).resolve()
    if tree.resolve() not in used.parents:  # an installed copy shadowed the tree under test
        raise SystemExit(f"ab.py: the run meant for {tree} imported minishard from {used}")
    return result["systems"]


def peak_rss_once(tree: Path, script: Path, nproc: int, args: list[str], name: str) -> float:
    """System ``name`` alone in a fresh torchrun job (``--only``, a few steps): its peak
    resident growth in MiB, max over ranks, or NaN if the run printed none."""
    keep, skip = [], False
    for a in args:  # --systems picks among several; --only runs one
        if skip or a == "--systems":
            skip = not skip
            continue
        keep.append(a)
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), *keep, "--only", name, "--steps", "5",
           "--warmup", "2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True).stdout
    m = re.search(r"peak growth ([\d.]+) MiB", out)
    return float(m.group(1)) if m else float("nan")


def verdict(ratios: list[float], band: float) -> str:
    if all(r > 1 + band for r in ratios):
        return "slower"
    if all(r < 1 - band for r in ratios):
        return "faster"
    return "no real difference"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("ref", help="the git ref to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--band", type=float, default=0.03,
                        help="a round counts as slower/faster only beyond 1 +- band")
    parser.add_argument("--script", default=str(REPO / "bench" / "zero_vs_stock.py"))
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak resident memory runs (one fresh job per system)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: the benchmark's arguments
    args, bench_args = parser.parse_args(argv[:cut]), argv[cut + 1:]
    with tempfile.TemporaryDirectory(prefix="minishard-ab-") as tmp:
        old_tree = Path(tmp) / "old"
        old_tree.mkdir()
        commit = lay_out(args.ref, old_tree)
        trees = {"old": old_tree, "new": REPO}
        print(f"A/B: old = {args.ref} ({commit[:10]}), new = the working tree {REPO}\n"
              f"benchmark: {Path(args.script).name} {' '.join(bench_args)}, "
              f"{args.nproc} ranks, {args.rounds} rounds, band {args.band:.0%}\n", flush=True)
        results: list[dict[str, dict]] = []
        for i in range(args.rounds):
            order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
            got = {side: run_once(trees[side], Path(args.script), args.nproc, bench_args,
                                  Path(tmp) / f"{side}{i}.json") for side in order}
            results.append(got)
            print(f"round {i + 1} ({' then '.join(order)}) done", flush=True)
        names = [n for n in results[0]["new"] if all(n in r["old"] for r in results)]
        rss = {} if args.no_memory else {
            (side, name): peak_rss_once(trees[side], Path(args.script), args.nproc, bench_args,
                                        name)
            for name in names for side in ("old", "new")}
    only = sorted(set(results[0]["new"]) ^ set(results[0]["old"]))
    head = (f"\n{'system':<36}" + "".join(f"{f'round {i + 1}':>9}" for i in range(args.rounds))
            + f"{'range':>14}  verdict (new/old of the median step time)")
    print(head + "\n" + "-" * len(head.strip()))
    for name in names:
        ratios = [r["new"][name]["median_ms"] / r["old"][name]["median_ms"] for r in results]
        control = not name.startswith("minishard")
        said = verdict(ratios, args.band)
        if control and said != "no real difference":
            said += "  <- a CONTROL moved: the machine drifted, measure again"
        print(f"{name:<36}" + "".join(f"{r:>9.3f}" for r in ratios)
              + f"{min(ratios):>7.3f}-{max(ratios):.3f}  {said}")
    ms = {side: {name: statistics.median(r[side][name]["median_ms"] for r in results)
                 for name in names} for side in ("old", "new")}
    print("\nmedian over rounds of each run's median ms: "
          + ", ".join(f"{n}: {ms['old'][n]:.1f} -> {ms['new'][n]:.1f}" for n in names
                      if n.startswith("minishard")))
    if rss:
        print("\npeak resident memory growth, MiB (each system alone in a fresh job, 5 steps, "
              "max over ranks):")
        for name in names:
            old, new = rss["old", name], rss["new", name]
            print(f"  {name:<34}{old:>8.1f} -> {new:>7.1f}  ({new - old:+.1f})")
    if only:
        print(f"in one tree only (not compared): {', '.join(only)}")


if __name__ == "__main__":
    main()
