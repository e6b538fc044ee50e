"""The line limit: 119 characters in every Python file, except the lines of string constants that are
kept verbatim (the A.3 prompts and the judge prompts one paragraph a line, the GPT-2 split pattern):
wrapping them would change the text the model reads.
Run: python -m pytest -q test_style.py
"""
import ast
import glob
import os

from testing import HERE

LIMIT = 119


def verbatim_lines(tree):
    """Line numbers inside module-level string constants named in capitals (NAME = "..." / f"...")."""
    rows = set()
    for node in tree.body:
        if (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)
                and isinstance(node.value, (ast.Constant, ast.JoinedStr))
                and isinstance(getattr(node.value, "value", ""), str)):
            rows.update(range(node.lineno, node.end_lineno + 1))
    return rows


def test_lines_fit_the_limit():
    files = sorted(glob.glob(os.path.join(HERE, "*.py")) + glob.glob(os.path.join(HERE, "data", "*.py")))
    long = []
    for path in files:
        src = open(path, encoding="utf-8").read()
        exempt = verbatim_lines(ast.parse(src))
        long += [f"{os.path.relpath(path, HERE)}:{i}" for i, line in enumerate(src.split("\n"), 1)
                 if len(line) > LIMIT and i not in exempt]
    assert not long, f"{len(long)} lines over {LIMIT} characters: {', '.join(long[:20])}"
