"""How much of minishard a reader must follow to understand one stage-3 training step.

The engine is read to learn how ZeRO works, so the path one step takes through the source is
measured, not guessed: every minishard function that runs during one warm step (forward,
backward, ``opt.step()``, ``zero_grad()``; default options, ``units={Block}``, 2 gloo ranks) is
recorded with ``sys.setprofile``, and its distinct functions, the files they live in and their
lines (each function's whole definition) are counted. Comprehensions and lambdas belong to the
function that holds them and are not counted again.

The budget is a ratchet: today's path (measured so: 52 functions in 7 files, 619 lines, of which
the flight record and the stamps' check, always on, are 3 functions and 25 lines of checks.py;
57 in 8 and 676 before each unit's state had one field and comm's checks a file of their own,
80 in 12 and 728 before the engine moved into zero/), which must never grow unseen: lower
BUDGET when the path shrinks. Also measured: the calls that climb back up the import
graph while the engine is built (a reader following ``stage`` down from the constructor).
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import torch
from torch import nn

PACKAGE = Path(__file__).resolve().parent.parent / "minishard"
BUDGET = dict(functions=52, files=7, lines=619)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


def _definition_lines(path: str) -> dict[tuple[str, int], int]:
    """(name, first line) -> lines of every function defined in ``path``."""
    out = {}
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[(node.name, node.lineno)] = node.end_lineno - first + 1
            out[(node.name, first)] = out[(node.name, node.lineno)]
    return out


def one_step_path() -> list[tuple[str, str, int]]:
    """(file, function, lines) of every minishard function one warm stage-3 step runs."""
    from minishard import ZeRO
    torch.manual_seed(0)
    model = ZeRO(nn.Sequential(*[Block(16) for _ in range(3)]), stage=3, units={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step()  # warm: the order is recorded, the optimizer has state
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            seen.add(frame.f_code)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    sizes, rows = {}, []
    for code in seen:
        if code.co_name.startswith("<"):
            continue
        if code.co_filename not in sizes:
            sizes[code.co_filename] = _definition_lines(code.co_filename)
        lines = sizes[code.co_filename].get((code.co_name, code.co_firstlineno), 0)
        rows.append((Path(code.co_filename).relative_to(PACKAGE).as_posix(), code.co_name, lines))
    return sorted(rows)


def test_one_stage3_step_reads_within_the_budget(pools):
    rows = pools(2).run(one_step_path)[0]
    got = dict(functions=len(rows), files=len({f for f, _, _ in rows}),
               lines=sum(n for *_, n in rows))
    listing = "\n".join(f"{f}:{name} ({n})" for f, name, n in rows)
    assert all(n > 0 for *_, n in rows), listing  # every function found in its file
    assert all(got[k] <= BUDGET[k] for k in BUDGET), f"{got} > {BUDGET}\n{listing}"


def climbs(fn) -> list[str]:
    """Calls, while ``fn()`` runs, from a minishard module into one that imports it (directly
    or not): a reader following the code down climbs back up there. Package ``__init__``
    files (the face re-exporting names, the command finder) are not modules a reader follows."""
    from test_budgets import files, imports_of, module
    graph = {module(p): imports_of(p) for p in files() if p.name != "__init__.py"}

    def below(mod: str) -> set[str]:
        seen, todo = set(), [mod]
        while todo:
            for m in graph.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    def ours(frame) -> str | None:
        path = Path(frame.f_code.co_filename)
        inside = path.is_relative_to(PACKAGE) and path.name != "__init__.py"
        return module(path) if inside else None

    found = set()

    def profile(frame, event, arg):
        callee = ours(frame) if event == "call" else None
        back = frame.f_back
        while callee and back is not None and ours(back) is None:
            back = back.f_back  # through torch's frames to the minishard code that called
        if callee and back is not None and ours(back) != callee and ours(back) in below(callee):
            found.add(f"{ours(back)}.{back.f_code.co_name} -> {callee}.{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(found)


def wrap_and_step_climbs() -> tuple[list[str], list[str]]:
    """The climbs of building ``ZeRO(..., stage=3)``, and of its first forward."""
    from minishard import ZeRO
    made = []
    build = climbs(lambda: made.append(
        ZeRO(nn.Sequential(*[Block(16) for _ in range(3)]), stage=3, units={Block})))
    return build, climbs(lambda: made[0](torch.randn(4, 16)))


def test_following_stage_climbs_back_up_at_most_once(pools):
    """Following ``stage`` from the constructor climbed back up the import graph 4 times on
    c13bab3 (as the issue counted it: the engine resharded what build.py left behind); today 0. The probe is not blind: a step's
    events climb by design (schedule.py emits into the engine's stream), and it sees them."""
    for build, step in pools(2).run(wrap_and_step_climbs):
        assert len(build) <= 1, build
        assert "zero.schedule.gather -> zero.engine._emit" in step, step


# The engine's core decides by stage; features attach from outside (engine.py's event stream).
# A condition (if, while, assert, conditional expression, comprehension filter) that names a
# feature is counted: Join, meters, deferred init, find_unused_parameters, activation
# checkpointing (a forward inside backward), replication. Buckets, prefetch and the order are
# the schedule itself; FlatMode names the stage's storage.
CORE = ["zero/engine.py", "zero/unit.py", "zero/flat.py", "zero/schedule.py"]
FEATURE = re.compile(r"join|shadow|meter|listener|deferred|is_meta|find_unused|replicat(?!ED)"
                     r"|Pass\.BACKWARD|_pass\b|in_backward", re.IGNORECASE)
FEATURE_CONDITIONS = 20


def feature_conditions(source: str) -> list[str]:
    tests = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
    return [seg for seg in (ast.get_source_segment(source, t) for t in tests) if FEATURE.search(seg)]


def test_the_core_names_few_features():
    found = [f"{name}: {c}" for name in CORE
             for c in feature_conditions((PACKAGE / name).read_text())]
    assert len(found) <= FEATURE_CONDITIONS, "\n".join(found)


def test_the_feature_count_can_fail():
    source = "if self.find_unused and x:\n    pass\ny = 1 if shadowing else [a for a in b if a.is_meta]\n"
    assert len(feature_conditions(source)) == 3
    assert feature_conditions("if mode is FlatMode.REPLICATED and bucket:\n    pass\n") == []
