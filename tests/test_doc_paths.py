"""Every repository path the docs and docstrings cite exists, and so does the name it points into.

Docstrings, comments and docs/ cite files several hundred times ("`engines/zero.py`",
"`tests/test_plan.py::test_...`", "`meshtron.models.generate.generate`", "[how](docs/data.md)"); a file
that moves or a function renamed would leave them pointing nowhere with nothing to say so. Checked:

  a path           whose first folder is one of the repository's (src, tests, docs, ...) or one of the
                   package's (parallel/, train/, ...), relative to the repository, to src/meshtron/,
                   to src/ or to the citing file's folder
  path:name        (or path::name) the name appears in that Python file
  meshtron.a.b.c   the longest prefix that is a module or package exists, and the next name appears in it
  [text](target)   a Markdown link's target, relative to the citing file (web links aside)

Paths under other roots are examples, not citations (`runs/demo/loss.png`, `DIR/config.json`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "meshtron"
ROOTS = {"src", "tests", "docs", "benchmarks", "configs", "examples", ".ci", "meshtron"} | {
    p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")
}
PATH = re.compile(
    r"(?<![\w./-])((?:\.\./)*(?:[\w.-]+/)+[\w.-]+\.(?:py|md|toml|sh|json|png))(?:::?([A-Za-z_]\w*))?"
)
MODULE = re.compile(r"(?<![\w./-])meshtron((?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def citing_files() -> list[Path]:
    return sorted(
        [*PACKAGE.rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
        + [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests").glob("*.py")]
    )


def checked_files() -> list[Path]:
    return [f for f in citing_files() if f != Path(__file__).resolve()]  # this file's examples are made up


def resolve(path: str, cited_in: Path) -> Path | None:
    bases = (ROOT, PACKAGE, ROOT / "src", cited_in.parent)
    return next((base / path for base in bases if (base / path).exists()), None)


def names(file: Path) -> str:
    return file.read_text() if file.suffix == ".py" else ""


def path_problems(line: str, cited_in: Path) -> list[str]:
    out = []
    for match in PATH.finditer(line):
        path, name = match.groups()
        if path.lstrip("./").split("/")[0] not in ROOTS:
            continue
        found = resolve(path, cited_in)
        if found is None:
            out.append(f"{path} does not exist")
        elif name and found.suffix == ".py" and not re.search(rf"\b{name}\b", names(found)):
            out.append(f"{path} has no {name}")
    return out


def module_problems(line: str) -> list[str]:
    out = []
    for match in MODULE.finditer(line):
        parts, base = match.group(1)[1:].split("."), PACKAGE
        while parts and ((base / parts[0]).is_dir() or (base / f"{parts[0]}.py").exists()):
            base = base / parts.pop(0)
        if not parts or parts[0] in {"py", "md", "toml", "json"}:
            continue
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not re.search(rf"\b{parts[0]}\b", module.read_text()):
            out.append(f"meshtron{match.group(1)}: {module.relative_to(ROOT)} has no {parts[0]}")
    return out


def link_problems(line: str, cited_in: Path) -> list[str]:
    targets = (m.group(1) for m in LINK.finditer(line))
    return [
        f"link {t} does not exist" for t in targets if "://" not in t and not (cited_in.parent / t).exists()
    ]


def test_every_cited_path_and_name_exists():
    problems = []
    for file in checked_files():
        for number, line in enumerate(file.read_text().splitlines(), 1):
            found = path_problems(line, file) + module_problems(line)
            if file.suffix == ".md":
                found += link_problems(line, file)
            problems += [f"{file.relative_to(ROOT)}:{number}: {p}" for p in found]
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_is_missing(tmp_path):
    cited_in = tmp_path / "x.md"
    assert path_problems("see `engines/zero.py:ZeroEngine` and src/meshtron/nope.py", cited_in) == [
        "engines/zero.py has no ZeroEngine",
        "src/meshtron/nope.py does not exist",
    ]
    assert path_problems("`train/optim.py:clip_grad_norm_`, runs/demo/loss.png", cited_in) == []
    assert module_problems("meshtron.models.generate.generate and meshtron.models.nowhere") == [
        "meshtron.models.nowhere: src/meshtron/models/__init__.py has no nowhere"
    ]
    assert link_problems("[a](missing.md#x) [b](https://example.org/x.md)", cited_in) == [
        "link missing.md does not exist"
    ]
