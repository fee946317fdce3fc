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
        assert (mutants.ROOT / path).is_file(), selection
        if test:
            tree = ast.parse((mutants.ROOT / path).read_text())
            assert test in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, \
                selection
