"""The layers of the code base are its packages, checked over the source's imports (at module level and
inside functions alike) and calls: every module imports only from its own package's layer or the ones
below (LAYERS, one package per line), with no import circle, typing-only imports included; comm/ is the
only caller of torch.distributed collectives; models/ never import what parallelises or trains them;
the configuration, the rules, the schedules and the planner stay pure (no torch: `meshtron plan`
starts without it); only pictures/ imports matplotlib; and no function or file grows past what a
reader can hold."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "meshtron"
# torch.distributed functions that move data between ranks (or wait on all of them).
COMM_PACKAGE = "comm/"
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "scatter",
    "gather",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
}


# The layers, lowest first, one package each: a module may import from its own package and the packages
# above it in this list. The package root holds the version (below everything) and `python -m meshtron`
# (__main__, above everything).
LAYERS: tuple[tuple[str, str], ...] = (
    ("meshtron.utils", "words for counts, the cache folder, a process's peak resident size, memos"),
    ("meshtron.config", "the config dataclasses, presets, the layout's degrees, Hugging Face config.json"),
    ("meshtron.schedules", "pipeline schedules and stage splits as data, and their simulator"),
    ("meshtron.rules", "whether a config can run: each subject's checks, and load_config"),
    ("meshtron.plan", "the planner: memory, FLOPs, communication and time of a layout, and its search"),
    ("meshtron.data", "tokenizers, corpora, prepared datasets, mixtures and the batch sampler"),
    ("meshtron.models", "the Llama-family transformer, MoE, attention kernels, loss, generation"),
    ("meshtron.comm", "collectives and their autograd rules, the mesh, the flight recorder, the phase clock"),
    ("meshtron.engines", "the data-parallel engines: DDP, ZeRO-1/2/3, FSDP, SimpleFSDP, expert DP"),
    (
        "meshtron.pipeline",
        "the pipeline runtime: a schedule's actions executed, zero-bubble's split backward",
    ),
    (
        "meshtron.parallel",
        "parallelize: tensor, context, expert parallel, float8, recompute, compile, regions",
    ),
    ("meshtron.hf", "Hugging Face checkpoints in and out"),
    ("meshtron.pictures", "every picture (matplotlib): mesh, schedules, context splits, loss, expert load"),
    ("meshtron.probe", "this machine measured: matmul, memory and gloo rates, the MFU reference"),
    ("meshtron.checkpoint", "distributed checkpoints: save, load on any layout, async, integrity"),
    ("meshtron.observe", "metrics, traces, memory by phase, stragglers, run records, summaries"),
    ("meshtron.train", "the training loop: set-up, the step, optimizer, evaluation, samples"),
    ("meshtron.testing", "parity harnesses, fuzzing and tiny models the tests and `verify` share"),
    ("meshtron.commands", "the command line"),
)
PURE = ("meshtron.utils", "meshtron.config", "meshtron.schedules", "meshtron.rules", "meshtron.plan")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """Index in LAYERS of `module`'s package (-1 for the root's version, len(LAYERS) for __main__)."""
    if module == "meshtron":
        return -1
    if module == "meshtron.__main__":
        return len(LAYERS)
    package = ".".join(module.split(".")[:2])
    index = next((i for i, (name, _) in enumerate(LAYERS) if name == package), None)
    assert index is not None, f"{module} is in no layer: add its package to LAYERS"
    return index


def layer_name(index: int) -> str:
    return LAYERS[index][0] if 0 <= index < len(LAYERS) else "root"


def meshtron_imports(path: Path, typing_too: bool = False) -> set[str]:
    """The meshtron modules `path` imports anywhere in its body (under `if TYPE_CHECKING:` too when
    `typing_too`)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    known = {module_name(p) for p in SRC.rglob("*.py")}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only and not typing_too:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("meshtron"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshtron"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
    return found


def import_graph(typing_too: bool = False) -> dict[str, set[str]]:
    return {module_name(p): meshtron_imports(p, typing_too) for p in sorted(SRC.rglob("*.py"))}


def test_every_package_is_a_layer_and_the_top_holds_three_modules_at_most():
    packages = {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert sorted(packages) == sorted(name.split(".")[1] for name, _ in LAYERS)
    assert len(list(SRC.glob("*.py"))) <= 3, sorted(p.name for p in SRC.glob("*.py"))


def test_no_module_imports_from_a_layer_above_it():
    upward = [
        f"{module} ({layer_name(layer_of(module))}) imports {target} ({layer_name(layer_of(target))})"
        for module, targets in import_graph(typing_too=True).items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_no_import_circles():
    """Depth-first search for a cycle over every import, typing-only ones included."""
    graph, state, circles = import_graph(typing_too=True), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert circles == []


def modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(SRC)), ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


def imported(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_comm_calls_collectives():
    callers = []
    for name, tree in modules():
        aliases = {"dist", "torch.distributed"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                callers += [f"{name}: imports {a.name}" for a in node.names if a.name in COLLECTIVES]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                # comm/pairwise.py: comm.py's collectives as point-to-point batches on gloo, called only by it
                if owner in aliases and node.func.attr in COLLECTIVES and not name.startswith(COMM_PACKAGE):
                    callers.append(f"{name}:{node.lineno}: {owner}.{node.func.attr}")
    assert callers == []


def test_models_never_import_the_parallelisms_or_the_training():
    above = ("comm", "engines", "pipeline", "parallel", "checkpoint", "observe", "train")
    wrong = [
        f"{name} imports {module}"
        for name, tree in modules()
        if name.startswith("models/")
        for module in imported(tree)
        if module.split(".")[:2] in (["meshtron", d] for d in above)
    ]
    assert wrong == []


def test_pure_layers_import_no_torch():
    """The utilities, the configuration, the schedules, the rules and the planner never import torch."""
    wrong = [
        f"{module_name(path)} imports {module}"
        for path in sorted(SRC.rglob("*.py"))
        if module_name(path).startswith(tuple(f"{p}." for p in PURE)) or module_name(path) in PURE
        for module in imported(ast.parse(path.read_text()))
        if module == "torch" or module.startswith("torch.")
    ]
    assert wrong == []


def test_only_pictures_import_matplotlib():
    wrong = [
        f"{name} imports {module}"
        for name, tree in modules()
        if not name.startswith("pictures/")
        for module in imported(tree)
        if module.split(".")[0] == "matplotlib"
    ]
    assert wrong == []


PLAN = [
    "plan",
    "--model.name=llama3-8b",
    "--gpus",
    "16",
    "--gpu",
    "h100",
    "--seq-len",
    "8192",
    "--global-batch",
    "64",
    "--top",
    "1",
]


def test_meshtron_plan_imports_no_torch():
    """`meshtron plan` (the command and the planner) runs without importing torch, so it starts at once."""
    script = (
        "import sys, time; start = time.perf_counter(); from meshtron.commands.main import main; "
        f"code = main({PLAN!r}); assert code == 0, code; "
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH'); "
        "import meshtron.rules.checks, meshtron.plan.search, meshtron.commands.pictures; "
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2:] == ["NO TORCH", "NO TORCH"]


def test_meshtron_plan_starts_in_well_under_a_second():
    """Importing the command and the planner (what precedes the search) takes a fraction of a second of
    this process's own CPU time (process_time: other processes' load does not count, as it does in a
    wall-clock or -X importtime reading, which read 0.71 s on a loaded CI machine for 0.2 s of work)."""
    code = (
        "import time; start = time.process_time()\n"
        "import meshtron.commands.main, meshtron.commands.plan, meshtron.plan.search, meshtron.plan.report\n"
        "print(time.process_time() - start)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seconds = float(out.stdout.split()[-1])
    assert seconds < 0.5, f"imports took {seconds:.2f} s of CPU time"


def test_functions_and_files_stay_small():
    """About 80 lines a function and 500 a file, so that each fits in a reader's head."""
    too_long = []
    for name, tree in modules():
        lines = (SRC / name).read_text().count("\n")
        if lines > 500:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 85:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert too_long == []


# Every private torch name the source reaches for (a torch release may change it without notice), and
# why. A new one fails the test below: make it a deliberate entry here, or use a public API.
PRIVATE_TORCH = {
    # the fused CPU flash-attention kernel returns the lse, which public SDPA does not
    "models/blockwise_attention.py": {
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward",
    },
    # float8 matmuls on tensor cores: scaled_mm has no public API yet (torchao calls the same operator)
    "models/float8.py": {"torch._scaled_mm"},
    # foreach kernels have no public alias; torch's own optimizers and clipping use them
    "engines/engine.py": {"torch._foreach_norm", "torch._foreach_mul_"},
    "probe/ranks.py": {"torch._foreach_mul_", "torch._foreach_zero_"},
    # torch.compiler.disable imports the compiler where it decorates (seconds of every run's start-up);
    # torch's own lazy form of it, which its optimizers use, imports it at the first call
    "models/moe.py": {"torch._disable_dynamo"},
    "engines/zero.py": {"torch._disable_dynamo"},
    "comm/counted.py": {"torch._disable_dynamo"},  # the collectives: one graph break each when compiled
    # the traceable (functional) collectives torch.compile puts in its graphs have no public module
    "comm/collectives.py": {"torch.distributed._functional_collectives"},
    # inductor's collective bucketing / reordering passes are switched on through its config
    "parallel/compile.py": {"torch._inductor"},
    # torch.save's pickle names torch._utils._rebuild_tensor_v2: the layout unpickler recognises the name
    # (it never imports or calls it)
    "checkpoint/saved_regions.py": {"torch._utils"},
    # the CUDA allocator's history with stacks (profile.memory_history) has no public API
    "observe/cuda_memory.py": {
        "torch.cuda.memory._record_memory_history",
        "torch.cuda.memory._dump_snapshot",
    },
}


def test_private_torch_names_are_listed():
    found: dict[str, set[str]] = {}
    dotted = re.compile(r"torch(?:\.\w+)*?\._(?!_)\w+")
    by_name = re.compile(r"getattr\((torch(?:\.\w+)*), \"(_\w+)\"")  # an operator looked up by name
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        names = set(dotted.findall(text)) | {f"{owner}.{name}" for owner, name in by_name.findall(text)}
        if names:
            found[str(path.relative_to(SRC))] = names
    assert found == PRIVATE_TORCH


def _module_state(tree: ast.Module) -> list[tuple[str, str]]:
    """(name, kind) of the module-level objects a run could change: empty containers, and instances of
    the module's own classes that are not frozen dataclasses (Memo instances say "memo")."""
    own = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            decorators = " ".join(ast.unparse(d) for d in node.decorator_list)
            own[node.name] = "frozen=True" not in decorators
    found = []
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        value = getattr(node, "value", None)
        if value is None or not all(isinstance(t, ast.Name) for t in targets):
            continue
        empty = isinstance(value, (ast.Dict, ast.List, ast.Set)) and not (
            getattr(value, "keys", None) or getattr(value, "elts", None)
        )
        called = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else ""
        no_arguments = isinstance(value, ast.Call) and not value.args and not value.keywords
        if empty or (called in ("dict", "list", "set") and no_arguments) or own.get(called):
            found += [(t.id, "state") for t in targets]
        elif called == "Memo":
            found += [(t.id, "memo") for t in targets]
    return found


def test_process_wide_state_is_listed_with_its_reason():
    """Every module-level object a run changes is named in meshtron/__init__.py's table, which says why
    it cannot be passed explicitly; memos (pure caches) live in the planner only."""
    table = (SRC / "__init__.py").read_text()
    unlisted, stray_memos = [], []
    for name, tree in modules():
        for variable, kind in _module_state(tree):
            if kind == "memo" and not name.startswith("plan/"):
                stray_memos.append(f"{name}: {variable}")
            elif kind == "state" and variable not in table:
                unlisted.append(f"{name}: {variable}")
    assert unlisted == [] and stray_memos == []


def test_every_quick_tier_entry_names_a_collected_test(request):
    """tests/conftest.py's QUICK names tests that exist (checked whenever their files are collected)."""
    from conftest import QUICK

    ids = [item.nodeid for item in request.session.items]
    files = {nodeid.split("::")[0] for nodeid in ids}
    if not {q.split("::")[0] for q in QUICK} <= files:
        pytest.skip("run with every file of the quick tier")
    missing = [q for q in QUICK if not any(i == q or i.startswith((q + "::", q + "[")) for i in ids)]
    assert missing == []
