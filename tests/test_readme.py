"""The README is a front door that works: short, and every command in it runs as written (scaled down).

Fenced ```bash blocks are runnable, one command a line; ```python blocks are run too. `make` targets run the commands
the Makefile gives them (`make -n`), and every run is shortened to a few tokens and prompts.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
BIN = Path(sys.executable).parent


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def scaled(argv: list[str], out: Path) -> list[str]:
    """The same command with few tokens and prompts, writing under `out`."""
    small = {"--max-new-tokens": "8", "--num-prompts": "1", "--out-dir": str(out / "bench")}
    return [small.get(argv[i - 1], arg) if i else arg for i, arg in enumerate(argv)]


def test_the_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_the_readme_has_the_two_commands_of_a_fresh_machine():
    assert ["make demo", "make test"] == [line.strip() for line in blocks("bash")[0].splitlines()]


COMMANDS = [line.strip() for block in blocks("bash") for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_shell_command_runs(command, tmp_path):
    argv = shlex.split(command)
    if argv[0] == "make":
        plan = subprocess.run(["make", "-n", *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert plan.returncode == 0, plan.stderr
        runs = [line for line in plan.stdout.replace("\\\n", " ").splitlines() if "specjax-" in line]
        if argv[1:] == ["test"]:
            assert "pytest" in plan.stdout  # the suite itself is what runs this test
            return
        assert runs, plan.stdout
        argv = shlex.split(runs[-1])
        argv[0] = Path(argv[0]).name
    assert argv[0].startswith("specjax-"), command
    result = subprocess.run(
        [str(BIN / argv[0]), *scaled(argv, tmp_path)[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() or any(tmp_path.rglob("*.json")), "the command printed and wrote nothing"


def test_the_library_example_runs():
    (code,) = blocks("python")
    assert "max_new_tokens=32" in code
    exec(compile(code.replace("max_new_tokens=32", "max_new_tokens=8"), "README.md", "exec"), {})
