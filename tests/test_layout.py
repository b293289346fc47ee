"""The package's shape: one installed package, its wings stacked with arrows only downward, and no import circle."""

import ast
import importlib.util
import subprocess
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
    for tool in ("generate", "serve", "bench"):
        assert "prepare_decoding" in names_in(ROOT / "cli" / f"{tool}.py"), tool


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
