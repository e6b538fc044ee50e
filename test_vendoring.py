"""Each building block vendors with its tests: the block, its test file and only what the test file's
"Vendors with:" line names, copied into an empty folder, pass there; "(no torch)" means they pass
with torch unimportable. With GEODEF_VENDOR_CHECK=1 (.ci/run sets it) these checks are the blocks'
only test runs: conftest.py deselects the same tests in the project folder, whatever was collected.
Without it (the README's command) the blocks' tests run in the project folder as well.
The blocks' runs are processes that share nothing, so they run side by side, as many at a time as
the machine has cores plus one (test_llm_clients.py's run mostly waits on its loopback servers); each
run's torch on one thread (the runs already fill the cores: a second thread per run would only wait
on the first), and pytest without the installed plugins (hypothesis, anyio, pytest-benchmark: no block
needs them, and loading them costs a run more than a second).
Run: python -m pytest -q test_vendoring.py
"""
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest

from testing import HERE

# slowest first: the runs start in this order, and test_llm_clients.py, which mostly waits, takes a
# worker while the others keep the cores busy
BLOCK_TESTS = ["test_llm_clients.py", "test_reranker.py", "test_lora.py", "test_gpt2.py", "test_offline_server.py",
               "test_geodef.py", "test_offline.py", "test_tfsg.py", "test_metrics.py", "test_accounting.py",
               "test_endpoints.py", "test_figures.py"]


def declared(test_file):
    """-> (files the test declares it needs, whether torch may be imported)."""
    doc = open(os.path.join(HERE, test_file), encoding="utf-8").read().split('"""')[1]
    m = re.search(r"^Vendors with: (.*(?:\n  .*)*)$", doc, re.M)   # indented lines continue it
    assert m, f"{test_file}: no 'Vendors with:' line in its docstring"
    line = m.group(1)
    return [w for w in line.replace("(no torch)", "").split()], "(no torch)" not in line


class Processes:
    """The blocks' processes: started under a lock, and after close() (which kills those still running)
    none is started."""

    def __init__(self):
        self.lock, self.started, self.closed = threading.Lock(), [], False

    def popen(self, *args, **kw):
        """subprocess.Popen(*args, **kw), or None once closed."""
        with self.lock:
            if self.closed:
                return None
            self.started.append(subprocess.Popen(*args, **kw))
            return self.started[-1]

    def close(self):
        with self.lock:
            self.closed = True
            for p in self.started:
                if p.poll() is None:
                    p.kill()


def run_alone(test_file, folder, processes):
    """Copy the block's test file, pytest.ini and its declared needs into the empty `folder` and run the
    test file there -> (exit status, the output's tail)."""
    files, torch_ok = declared(test_file)
    for f in [test_file, "pytest.ini"] + files:
        os.makedirs(os.path.dirname(str(folder / f)) or str(folder), exist_ok=True)
        shutil.copy(os.path.join(HERE, f), str(folder / f))
    if not torch_ok:                         # a package named torch that refuses to be imported
        (folder / "torch").mkdir()
        (folder / "torch" / "__init__.py").write_text("raise ImportError('torch is not a need of this block')\n")
    env = {**os.environ, "PYTHONPATH": str(folder), "OMP_NUM_THREADS": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("GEODEF_VENDOR_CHECK", None)     # inside the folder the block's tests are the run, not deselected
    p = processes.popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                        cwd=str(folder), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if p is None:
        return None, "not run: the module's teardown came first"
    try:
        out, err = p.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        err += "\n(killed after 900 s)"
    return p.returncode, (out + err)[-6000:]    # the failures' summary: this is the block's only test run


@pytest.fixture(scope="module")
def block_runs(request, tmp_path_factory):
    """The selected blocks' runs, all submitted when the first is needed -> {test file: future of
    run_alone's (exit status, output tail)}. At teardown (early in an interrupted session) runs not
    started are cancelled and those running killed."""
    selected = {item.callspec.params["test_file"] for item in request.session.items
                if item.module.__name__ == __name__ and hasattr(item, "callspec")}
    processes = Processes()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=(os.cpu_count() or 1) + 1)
    runs = {f: pool.submit(run_alone, f, tmp_path_factory.mktemp(f[:-3]), processes)
            for f in BLOCK_TESTS if f in selected}
    yield runs
    processes.close()
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("test_file", BLOCK_TESTS)
def test_block_passes_alone_with_its_declared_needs(test_file, block_runs):
    returncode, tail = block_runs[test_file].result()
    assert returncode == 0 and re.search(r"\d+ passed", tail), tail
