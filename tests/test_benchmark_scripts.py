"""The benchmark scripts cannot rot silently: each imports, and every method a script overrides on one of
meshtron's classes (a timed Comm, a counting CommStats) still takes the parameters the original takes, so
the library's callers do not break it mid-run (expert_parallel.py's timed Comm once lost reduce-scatter's
`consume` and failed after its layouts had run). Running them is the benchmarks' own job: minutes each."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))


@pytest.fixture(scope="module", autouse=True)
def on_path():
    """The scripts import each other by name (harness, reporting); their generic names leave with them."""
    before = set(sys.modules)
    sys.path.insert(0, str(BENCHMARKS))
    yield
    sys.path.remove(str(BENCHMARKS))
    for name in set(sys.modules) - before:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(BENCHMARKS)):
            del sys.modules[name]


def _overrides(module) -> list[tuple[str, object, object]]:
    """(name, override, original) of every method a class of `module` overrides on a meshtron base."""
    out = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        for base in cls.__mro__[1:]:
            if not base.__module__.startswith("meshtron."):
                continue
            for name, method in vars(cls).items():
                original = vars(base).get(name)
                if callable(method) and callable(original) and not name.startswith("__"):
                    out.append((f"{cls.__name__}.{name}", method, original))
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_imports_and_keeps_its_bases_signatures(script):
    module = importlib.import_module(script)
    for name, method, original in _overrides(module):
        mine = inspect.signature(method).parameters
        missing = [p for p in inspect.signature(original).parameters if p not in mine]
        assert not missing, f"benchmarks/{script}.py {name} lacks {missing} that meshtron passes"
