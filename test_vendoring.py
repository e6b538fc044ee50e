"""Each building block vendors with its tests: the block, its test file and only what the test file's
"Vendors with:" line names, copied into an empty folder, pass there; "(no torch)" means they pass
with torch unimportable. In a session that runs these checks they are the blocks' test runs
(conftest.py deselects the same tests in the project folder).
Run: python -m pytest -q test_vendoring.py
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import HERE

BLOCK_TESTS = ["test_tfsg.py", "test_metrics.py", "test_endpoints.py", "test_accounting.py", "test_llm_clients.py",
               "test_geodef.py", "test_gpt2.py", "test_reranker.py", "test_lora.py", "test_offline.py",
               "test_offline_server.py"]


def declared(test_file):
    """-> (files the test declares it needs, whether torch may be imported)."""
    doc = open(os.path.join(HERE, test_file), encoding="utf-8").read().split('"""')[1]
    m = re.search(r"^Vendors with: (.*(?:\n  .*)*)$", doc, re.M)   # indented lines continue it
    assert m, f"{test_file}: no 'Vendors with:' line in its docstring"
    line = m.group(1)
    return [w for w in line.replace("(no torch)", "").split()], "(no torch)" not in line


@pytest.mark.parametrize("test_file", BLOCK_TESTS)
def test_block_passes_alone_with_its_declared_needs(test_file, tmp_path):
    files, torch_ok = declared(test_file)
    for f in [test_file, "pytest.ini"] + files:
        os.makedirs(os.path.dirname(str(tmp_path / f)) or str(tmp_path), exist_ok=True)
        shutil.copy(os.path.join(HERE, f), str(tmp_path / f))
    if not torch_ok:                         # a package named torch that refuses to be imported
        (tmp_path / "torch").mkdir()
        (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch is not a need of this block')\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    tail = (p.stdout + p.stderr)[-6000:]        # the failures' summary: this is the block's only test run
    assert p.returncode == 0 and re.search(r"\d+ passed", tail), tail
