"""The built-in training text: deterministic, HumanEval kept out, held-out functions kept out of the source answers."""

import itertools
import re
import subprocess
import sys

from specjax.train.prompts import builtin_prompts, humaneval_entry_points, stdlib_source_answers, stub_names


def _defined(text: str) -> set[str]:
    return set(re.findall(r"^\s*def (\w+)", text, flags=re.M))


def test_builtin_prompts_are_deterministic_and_never_humaneval():
    prompts = builtin_prompts(seed=0)
    assert len(prompts) > 1500 and prompts == builtin_prompts(seed=0) and prompts != builtin_prompts(seed=1)
    entry_points = humaneval_entry_points()
    assert len(entry_points) >= 160 and {"has_close_elements", "fizz_buzz"} <= entry_points
    assert not any(_defined(p) & entry_points for p in prompts)


def test_builtin_prompts_are_the_same_in_every_process():
    """Stubs whose defaults are objects (addresses in their repr) or os.environ (the environment) show `...`, so a
    fresh process, with other addresses and another environment, writes the same prompts (and finds its store units)."""
    code = "from specjax.train.prompts import builtin_prompts; print(hash(tuple(builtin_prompts(0))))"
    env = {"PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin"}
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={**env, "EXTRA": str(i)}, check=True
        ).stdout
        for i in range(2)
    }
    assert len(runs) == 1
    prompts = builtin_prompts(seed=0)
    assert not any(" at 0x" in p or "environ(" in p for p in prompts)
    assert any("=...," in p or "=...)" in p for p in prompts)


def test_source_answers_are_fenced_blocks_without_excluded_functions():
    first = list(itertools.islice(stdlib_source_answers(set(), seed=0), 200))
    assert first == list(itertools.islice(stdlib_source_answers(set(), seed=0), 200))
    for question, answer in first:
        assert question.startswith("Show the source code of the Python module `")
        assert answer.startswith("```python\n") and answer.endswith("\n```")
        assert len(answer.splitlines()) <= 24 + 2
    excluded = stub_names([answer for _, answer in first[:50]])
    assert len(excluded) > 10
    kept = list(itertools.islice(stdlib_source_answers(excluded, seed=0), 200))
    assert kept and not any(_defined(answer) & excluded for _, answer in kept)
