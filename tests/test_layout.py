"""The package's shape: one installed package, its wings stacked with arrows only downward, no import circle, and
each drafter's name spelled only in its module and the registry."""

import ast
import importlib.util
import re
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import specjax

ROOT = Path(specjax.__file__).parent
REPO = ROOT.parent
# Bottom to top. A module may import modules of its own layer or below, never above: the command line is the top
# wing, and the front door (`specjax/__init__.py`) re-exports from everything but it.
LAYERS = [
    "specjax.errors",
    "specjax.host",
    "specjax.config",
    "specjax.sampling",
    "specjax.sharding",
    "specjax.models",
    "specjax.io",
    "specjax.evalsets",
    "specjax.drafters",
    "specjax.adaptive",
    "specjax.decoding",
    "specjax.measure",
    "specjax.prepare",
    "specjax.serving",
    "specjax.train",
    "specjax",
    "specjax.cli",
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def imports_of(path: Path) -> set[str]:
    """Every specjax module the file imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "specjax"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "specjax":
            for alias in node.names:  # `from specjax.x import y` imports the module specjax.x.y where y is one
                sub = f"{node.module}.{alias.name}"
                found.add(sub if is_module(sub) else node.module)
    return found


def layer(name: str) -> int:
    """The layer of the longest prefix of `name` in LAYERS."""
    matches = [i for i, prefix in enumerate(LAYERS) if name == prefix or name.startswith(prefix + ".")]
    return max(matches, key=lambda i: len(LAYERS[i]))


GRAPH = {module_name(p): imports_of(p) for p in ROOT.rglob("*.py")}


def test_every_module_is_in_a_layer():
    assert all(name == "specjax" or layer(name) != LAYERS.index("specjax") for name in GRAPH), [
        name for name in GRAPH if name != "specjax" and layer(name) == LAYERS.index("specjax")
    ]


def test_imports_only_point_down_and_the_cli_is_imported_by_nothing():
    upward = [(a, b) for a, targets in GRAPH.items() for b in targets if layer(b) > layer(a)]
    assert not upward, upward
    into_cli = [(a, b) for a, targets in GRAPH.items() for b in targets if layer(b) == LAYERS.index("specjax.cli")]
    assert all(layer(a) == LAYERS.index("specjax.cli") for a, _ in into_cli), into_cli


def test_the_import_graph_has_no_cycle():
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for target in sorted(GRAPH.get(name, ())):
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(target) :] + [target]))
            if target not in state:
                visit(target, [*stack, target])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


# The steps of setting decoding up, which `specjax.prepare.prepare_decoding` takes in order: building the drafter,
# fixing and checking its K, calibrating an adaptive menu, planning and checking the memory.
SETUP_STEPS = {
    "drafter_from_spec",
    "draft_loader",
    "with_lookup_tokens",
    "check_inputs",
    "as_policy",
    "calibrated",
    "auto_max_drafts",
    "memory_plan",
    "check_fits",
}


def names_in(path: Path) -> set[str]:
    """Every name a file uses: variables, attributes and what it imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= {alias.name.split(".")[-1] for alias in node.names}
    return found


def test_the_decoding_tools_set_decoding_up_by_the_one_library_call():
    for path in (ROOT / "cli").glob("*.py"):
        assert not names_in(path) & SETUP_STEPS, (path.name, names_in(path) & SETUP_STEPS)
    for tool in ("generate", "bench"):
        assert "prepare_decoding" in names_in(ROOT / "cli" / f"{tool}.py"), tool
    assert "serving_engine" in names_in(ROOT / "cli" / "serve.py")  # prepare_decoding for each bucket of slots


def test_the_layout_check_sees_an_upward_import():
    """The checker itself: a drafter importing the loop would be caught."""
    assert layer("specjax.decoding.speculative") > layer("specjax.drafters.eagle3")
    assert layer("specjax.cli.bench") > layer("specjax") > layer("specjax.train.run")
    assert "specjax.decoding.autoregressive" in GRAPH["specjax.measure.timing"]


def test_only_specjax_is_installed_and_the_scripts_live_in_its_cli():
    dist = distribution("specjax")
    assert dist.read_text("top_level.txt").split() == ["specjax"]
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert set(scripts) == {"specjax-generate", "specjax-bench", "specjax-train", "specjax-serve"}
    assert all(value.startswith("specjax.cli.") for value in scripts.values())


def test_the_top_level_is_the_design_cards():
    """specjax/ (the library), decode/ and train/ (what a checkout runs), configs/, tests/ and pyproject.toml, plus
    the docs, the front door and the two entry points: nothing else is tracked at the top."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    top = {line.split("/")[0] for line in tracked.splitlines()}
    assert top == {"specjax", "decode", "train", "configs", "tests", "pyproject.toml"} | {
        "docs",
        "README.md",
        "Makefile",
        ".ci",
        ".gitignore",
    }, top
    for folder, library in (("decode", "specjax.decoding"), ("train", "specjax.train")):
        first = (REPO / folder / "README.md").read_text().splitlines()
        assert library in " ".join(first[:3]), (folder, first[:3])
    assert not (REPO / "decode" / "__init__.py").exists() and not (REPO / "train" / "__init__.py").exists()


def spelled_drafter_names(path: Path, kinds: set[str]) -> list[tuple[int, str, str]]:
    """(line, kind, text) of each place in a source file that spells a drafter's kind as a drafter name: a string
    literal holding a spec token (`KIND:ARG`, `KIND[:N]`, `KIND+SPEC`, `SPEC+KIND`, a bench mode `KIND-chain` /
    `KIND-tree`), or a literal that is exactly KIND compared against (`mode == "KIND"`, `kind in ("KIND", ...)`)."""
    tree = ast.parse(path.read_text())
    found = []
    for kind in kinds:
        k = re.escape(kind)
        token = re.compile(rf"(?<![\w.-]){k}(:(?=[\w{{/.~\[]|$)|\[:|\+|-(chain|tree)\b)|\+{k}(?![\w-])")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and token.search(node.value):
                found.append((node.lineno, kind, node.value))
            elif isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    found += [
                        (node.lineno, kind, c.value)
                        for c in ast.walk(side)
                        if isinstance(c, ast.Constant) and c.value == kind
                    ]
    return found


def test_no_drafter_name_is_spelled_outside_its_module_and_the_registry():
    """Adding or removing a drafter touches its module and its registration: no other source file of the package,
    the command-line tools included (their help comes from the registry), spells a registered drafter's name.

    What counts (`spelled_drafter_names`): spec tokens in string literals (`eagle3:PATH`, `ngram[:N]`, `ngram+eagle3`,
    `eagle3-tree`) and literals that are exactly a name compared against (`mode == "ngram"`). Prose ("EAGLE-3",
    "n-gram"), module paths (`specjax.models.eagle3`) and other words equal to a name used as such (the JSON field
    "model") do not count. Where a name may appear: the registry (`registry.py` and its `entry.py`), the module that
    defines the entry, the modules named after it (`models/eagle3.py`, `io/eagle3_checkpoint.py`: the model and
    checkpoint format it loads) and `specjax/train/`, whose `model.drafter` names the kind of draft to train (a
    training kind, not a drafting spec)."""
    from specjax.drafters import entries

    registry = {ROOT / "drafters" / "registry.py", ROOT / "drafters" / "entry.py"}
    spelled = []
    for entry in entries():
        module = sys.modules[entry.build.__module__]
        if not module.__name__.startswith("specjax."):
            continue  # a drafter registered from outside the package (the tests' own)
        allowed = registry | {Path(module.__file__)}
        for path in ROOT.rglob("*.py"):
            own = path.stem == entry.kind or path.stem.startswith(entry.kind + "_")
            if path in allowed or own or (ROOT / "train") in path.parents:
                continue
            spelled += [(str(path.relative_to(REPO)), *hit) for hit in spelled_drafter_names(path, {entry.kind})]
    assert not spelled, spelled


def test_the_name_check_sees_a_spec_a_mode_and_a_comparison(tmp_path):
    source = tmp_path / "tool.py"
    source.write_text(
        'HELP = "--drafter eagle3:PATH"\nMODES = ("eagle3-tree",)\nLOOKUP = f"ngram+{x}"\n'
        'def f(mode):\n    return mode == "layerskip"\n'
        '"""specjax.models.eagle3 reads an EAGLE-3 head; layerskip drafting; the n-gram size."""\n'
    )
    hits = spelled_drafter_names(source, {"eagle3", "ngram", "layerskip"})
    assert sorted((line, kind) for line, kind, _ in hits) == [
        (1, "eagle3"),
        (2, "eagle3"),
        (3, "ngram"),
        (5, "layerskip"),
    ]
