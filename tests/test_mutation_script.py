"""tests/mutants.py must stay applicable: every patch finds its text exactly once in today's
engine, the patched module still compiles, and every test it names exists. (Running the mutants
takes minutes; that is `python tests/mutants.py`, not part of the suite.)"""
import ast
from pathlib import Path

import pytest

import mutants


@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_mutant_still_applies_and_names_real_tests(name):
    for path, text in mutants.patched_sources(name).items():
        assert text != (mutants.ROOT / path).read_text()
        compile(text, path, "exec")
    for selection in mutants.MUTANTS[name][2]:
        path, _, test = selection.partition("::")
        test = test.partition("[")[0]  # a parametrized case: its function
        assert (mutants.ROOT / path).is_file(), selection
        if test:
            tree = ast.parse((mutants.ROOT / path).read_text())
            assert test in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, \
                selection


def test_the_kill_check_fails_on_a_survivor_and_passes_on_a_kill(monkeypatch, capsys):
    """``python tests/mutants.py`` exits 1 when a mutant survives its tests, 0 when each is
    killed: here a harmless patch (a comment) survives, and a wrong ZeRO memory formula (grads
    never sharded) is killed by the paper's Figure 1 numbers. Every mutant's kills are checked
    by running the script; its last full run is recorded in bench/RESULTS.md."""
    monkeypatch.setitem(mutants.MUTANTS, "harmless", (
        "a comment changed: nothing can notice",
        [("minishard/observe/memory.py", "    sharded = psi - replicated",
          "    sharded = psi - replicated  # harmless")],
        ["tests/test_plan.py::test_paper_figure_1_numbers"]))
    monkeypatch.setitem(mutants.MUTANTS, "grads_never_sharded", (
        "the ZeRO formula never shards gradients",
        [("minishard/observe/memory.py", '"grads": stage >= 2', '"grads": stage >= 9')],
        ["tests/test_plan.py::test_paper_figure_1_numbers"]))
    assert mutants.main(["harmless"]) == 1
    assert mutants.main(["grads_never_sharded"]) == 0
    out = capsys.readouterr().out
    assert "survived  tests/test_plan.py" in out and "KILLED by tests/test_plan.py" in out
