"""Training text that needs no download: code stubs from this Python's standard library, plus templated tasks, as
prompts for the target; and the standard library's own source, framed as assistant answers.

The stubs (a signature and docstring, "complete this function") have the shape of HumanEval prompts without being
HumanEval problems; functions named like a HumanEval entry point are dropped so the sets never overlap.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import re
import sys
import sysconfig
import warnings
from pathlib import Path

# Modules that open windows, print on import, or are platform specific.
_SKIP_MODULES = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "lib2to3",
    "pydoc_data",
    "test",
    "ensurepip",
    "venv",
    "msilib",
    "winreg",
    "winsound",
    "nturl2path",
    "xxsubtype",
    "sre_compile",
    "sre_parse",
    "sre_constants",
}

_TASKS = [
    "reverses the words in a sentence",
    "checks whether a string is a palindrome",
    "counts the vowels in a string",
    "returns the n-th Fibonacci number",
    "merges two sorted lists into one sorted list",
    "flattens a nested list",
    "removes duplicates from a list while keeping the order",
    "computes the factorial of n iteratively",
    "finds the second largest number in a list",
    "converts a Roman numeral to an integer",
    "converts an integer to binary without using bin()",
    "checks whether two strings are anagrams",
    "returns the most common word in a text",
    "computes the greatest common divisor of two numbers",
    "transposes a matrix given as a list of lists",
    "groups a list of words by their first letter",
    "parses a date in YYYY-MM-DD format and returns the weekday",
    "validates an email address with a regex",
    "computes the running average of a list",
    "rotates a list by k positions",
    "finds all primes below n",
    "capitalizes the first letter of every word",
    "returns the longest common prefix of a list of strings",
    "chunks a list into pieces of size n",
    "computes the dot product of two vectors",
    "counts the occurrences of each character in a string",
    "sorts a list of dictionaries by a given key",
    "returns the median of a list of numbers",
    "checks whether brackets in a string are balanced",
    "implements binary search on a sorted list",
    "computes the power set of a list",
    "converts a temperature from Celsius to Fahrenheit",
    "reads a CSV file and returns the rows as dictionaries",
    "returns the indices of two numbers that add up to a target",
    "compresses a string with run-length encoding",
    "computes the Levenshtein distance between two strings",
    "checks whether a year is a leap year",
    "returns the digits of an integer as a list",
    "finds the maximum subarray sum",
    "implements a simple stack class",
    "implements a queue using two stacks",
    "counts the lines, words and characters of a text file",
    "returns a dictionary inverted (values become keys)",
    "generates all permutations of a string",
    "converts snake_case to camelCase",
    "computes compound interest",
    "checks whether a number is a perfect square",
    "returns the sum of the digits of a number",
    "finds the intersection of two lists",
    "formats a number of seconds as HH:MM:SS",
]

_TEMPLATES = [
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Include a docstring and type hints.",
    "Implement a function in Python that {task}, and explain how it works.",
    "Write a Python function that {task}, then show an example call.",
    "How would you write a Python function that {task}? Keep it short.",
]

_TOPICS = [
    "recursion",
    "hash tables",
    "the Python GIL",
    "list comprehensions",
    "decorators",
    "generators",
    "unit testing",
    "binary search",
    "big-O notation",
    "git branches",
    "HTTP status codes",
    "SQL joins",
    "regular expressions",
    "garbage collection",
    "virtual environments",
    "exceptions in Python",
    "dynamic programming",
    "linked lists",
    "the difference between a list and a tuple",
    "closures",
    "type hints",
    "context managers",
    "async and await",
]

_EXPLAIN = [
    "Explain {topic} to a beginner.",
    "What are common mistakes with {topic}?",
    "Give a short example that illustrates {topic}.",
    "Summarise {topic} in three bullet points.",
]


class _Elided:
    """Stands for a default value that is not a literal: its repr is `...`."""

    def __repr__(self) -> str:
        return "..."


def _is_literal(value) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _signature(obj) -> str:
    """The signature with every default that is not a literal shown as `...`: the repr of an object holds its
    address, which changes from process to process (and os.environ's holds the environment), so the prompts would
    differ between runs."""
    signature = inspect.signature(obj)
    params = [
        p if p.default is p.empty or _is_literal(p.default) else p.replace(default=_Elided())
        for p in signature.parameters.values()
    ]
    return str(signature.replace(parameters=params))


def _stub(obj) -> str | None:
    """A HumanEval-like prompt: the function's signature and docstring, body left out."""
    doc = inspect.getdoc(obj)
    if not doc or len(doc) < 40 or len(doc) > 1200:
        return None
    try:
        signature = _signature(obj)
    except (TypeError, ValueError):
        return None
    body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
    return f'def {obj.__name__}{signature}:\n    """\n{body}\n    """\n'


def stdlib_stubs(exclude_names: set[str]) -> list[str]:
    """Function and method stubs from the standard library of the running Python, in a deterministic order."""
    stubs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(sys.stdlib_module_names):
            if name.startswith("_") or name in _SKIP_MODULES:
                continue
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - platform-specific modules fail in many ways
                continue
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                    continue
                # Module functions, and the methods of the module's classes.
                members = sorted(vars(obj).items()) if inspect.isclass(obj) else [(attr, obj)]
                for member_name, member in members:
                    if member_name.startswith("_") or member_name in exclude_names or not inspect.isfunction(member):
                        continue
                    if stub := _stub(member):
                        stubs.append(stub)
    return stubs


def humaneval_entry_points() -> set[str]:
    """Names of the HumanEval functions, to keep them out of training."""
    from specjax.evalsets import humaneval_prompts

    return stub_names(humaneval_prompts())


def builtin_prompts(seed: int = 0) -> list[str]:
    """specjax's built-in training prompt set, shuffled with `seed`."""
    prompts = stdlib_stubs(humaneval_entry_points())
    prompts += [t.format(task=task) for task in _TASKS for t in _TEMPLATES]
    prompts += [t.format(topic=topic) for topic in _TOPICS for t in _EXPLAIN]
    random.Random(seed).shuffle(prompts)
    return prompts


_SOURCE_BLOCK_LINES = 24  # about as many tokens as a regenerated response


def _def_names(text: str) -> set[str]:
    return set(re.findall(r"^\s*def (\w+)", text, flags=re.M))


def stdlib_source_answers(exclude_names: set[str], seed: int = 0):
    """(question, answer) pairs over the standard library's `.py` files, in a `seed`-shuffled file order: the answer
    is a block of whole lines of one file (at most 24), fenced as Python. Blocks that define a function named in
    `exclude_names` (held-out or HumanEval functions) are left out. A generator: callers take what they need."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "dist-packages", "test", "tests"}
    files = sorted(
        p for p in root.rglob("*.py") if not skipped & set(p.parts) and p.parts[len(root.parts)] not in _SKIP_MODULES
    )
    random.Random(seed).shuffle(files)
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        for start in range(0, len(lines), _SOURCE_BLOCK_LINES):
            block = "\n".join(lines[start : start + _SOURCE_BLOCK_LINES]).strip("\n")
            if len(block) < 200 or _def_names(block) & exclude_names:
                continue
            part = f" (lines {start + 1}-{min(start + _SOURCE_BLOCK_LINES, len(lines))})"
            yield f"Show the source code of the Python module `{name}`{part}.", f"```python\n{block}\n```"


def stub_names(stubs: list[str]) -> set[str]:
    """The function names defined by prompts (e.g. the held-out stubs)."""
    return set().union(*(_def_names(s) for s in stubs))
