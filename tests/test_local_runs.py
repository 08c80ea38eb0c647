"""np < 0: ranks on this host, Horovod over Gloo, no Spark."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import jobs
import psutil
import pytest
from jobs import (
    allreduce_sum,
    assert_all_gone,
    cancel_once_running,
    fail_on_rank,
    sleep_and_record,
    train_linear,
    wait_for_pids,
)

from airflow_provider_hvd import HorovodRunner, RankFailedError, RunCancelledError


def test_allreduce_across_two_ranks_returns_rank0_value():
    result = HorovodRunner(np=-2).run(allreduce_sum, base=10.0)
    assert result == {"rank": 0, "size": 2, "local_size": 2, "sum": 11.0 + 12.0}


SCRIPT_BESIDE_ITS_HELPERS = {
    "job.py": """
from airflow_provider_hvd import HorovodRunner
from helpers import Scaled
from lib.maths import triple

def main(factor):
    import horovod.torch as hvd, torch
    hvd.init()
    total = hvd.allreduce(torch.tensor(float(hvd.rank() + 1)), op=hvd.Sum).item()
    return Scaled(factor).of(triple(total))

print("rank 0 returned", HorovodRunner(np=-2).run(main, factor=2))
""",
    "helpers.py": """
class Scaled:
    def __init__(self, k):
        self.k = k

    def of(self, x):
        return self.k * x
""",
    "lib/__init__.py": "",
    "lib/maths.py": "def triple(x):\n    return 3 * x\n",
}


@pytest.mark.parametrize("through", ["its folder", "a link to its folder"])
def test_a_scripts_helper_modules_beside_it_travel_with_the_job(tmp_path, through):
    """`python job.py` importing helpers.py and lib/ from its folder: the ranks, which run elsewhere and cannot
    import them, get them with the job. Also where the folder is reached through a symbolic link (a git-sync'd
    DAGs folder, a mounted checkout): Python imports the helpers from the link's target, not from the link."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name, text in SCRIPT_BESIDE_ITS_HELPERS.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    folder = project
    if through == "a link to its folder":
        folder = tmp_path / "current"
        folder.symlink_to(project, target_is_directory=True)
    proc = subprocess.run(
        [sys.executable, str(folder / "job.py")], cwd=elsewhere, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 returned 18.0" in proc.stdout  # 2 * 3 * (1 + 2)


HELPER_BESIDE_MAIN = "WHERE = 'helper.py'\n\n\ndef where_main_is():\n    return f'main from {WHERE}'\n"


@pytest.mark.parametrize("imported_first", ["torch", "multiprocessing"])
@pytest.mark.parametrize(
    "runner",
    ["HorovodRunner(np=-2)", "TorchDistributor(2, local_mode=True, use_gpu=False)"],
    ids=["HorovodRunner", "TorchDistributor"],
)
def test_main_from_a_helper_module_beside_a_script_that_imports_multiprocessing(tmp_path, runner, imported_first):
    """`main.py` doing `import torch; import helper; runner.run(helper.main)`, the commonest layout. torch imports
    multiprocessing, which makes `__mp_main__` an alias of `__main__` in sys.modules. Before: ValueError:
    <module '__main__' from '.../main.py'> is not registered for pickle by value, from cloudpickle, before any rank
    started (main.py was listed twice beside helper.py, and unregistered twice)."""
    (tmp_path / "helper.py").write_text(HELPER_BESIDE_MAIN)
    (tmp_path / "main.py").write_text(
        f"import {imported_first}\n"
        "import helper\n"
        "from airflow_provider_hvd import HorovodRunner, TorchDistributor\n"
        f"print('rank 0 returned', {runner}.run(helper.where_main_is))\n"
    )
    proc = subprocess.run(
        [sys.executable, "main.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 returned main from helper.py" in proc.stdout


def test_distributed_training_converges_with_equal_weights():
    result = HorovodRunner(np=-2).run(train_linear)
    assert result["rank"] == 0
    assert result["final_loss"] < 0.01 < result["first_loss"]
    (w0, b0), (w1, b1) = result["weights"]
    assert (w0, b0) == (w1, b1), "broadcast + allreduced gradients keep the ranks' weights identical"
    assert w0 == pytest.approx(3.0, abs=0.05) and b0 == pytest.approx(-2.0, abs=0.05)


def test_failing_rank_raises_with_its_traceback_and_ends_the_others(pid_dir):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2).run(fail_on_rank, bad_rank=1, pid_dir=pid_dir)
    assert time.monotonic() - started < 30
    err = info.value
    assert err.rank == 1
    assert "ValueError: boom from rank 1" in str(err)
    assert f'File "{jobs.__file__}", line ' in err.remote_traceback  # by-value code, with its file
    assert "in fail_on_rank\n    raise ValueError(" in err.remote_traceback  # ... and its lines
    assert err.remote_traceback.rstrip().endswith("ValueError: boom from rank 1")
    assert "rank 1 is about to fail" in err.output_tail
    assert err.other_failures == ["rank 0: ended by the driver (rank 1 failed)"]
    assert_all_gone(wait_for_pids(pid_dir, 2, timeout=1))


def leftover_rank_processes() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "airflow_provider_hvd.runner.rank" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # gone, or a zombie: not running
            continue
    return found


def test_rank_exiting_without_exception_is_reported_within_seconds(pid_dir):
    started = time.monotonic()
    with pytest.raises(
        RankFailedError, match="rank 0 of 2 failed: exited with code 3 without a Python exception"
    ) as info:
        HorovodRunner(np=-2).run(fail_on_rank, bad_rank=0, pid_dir=pid_dir, how="exit")
    assert time.monotonic() - started < 20
    assert info.value.exit_code == 3 and info.value.remote_traceback is None
    assert_all_gone(wait_for_pids(pid_dir, 2, timeout=1))
    assert not leftover_rank_processes(), "the driver has leftover rank processes"


def test_unpicklable_result_is_named():
    def make_lock():
        import threading

        return threading.Lock()

    with pytest.raises(RankFailedError, match="rank 0's return value, a lock, cannot be pickled .* return its path"):
        HorovodRunner(np=-2).run(make_lock)


def test_cancel_ends_every_rank_and_raises(pid_dir):
    error, pids, took = cancel_once_running(HorovodRunner(np=-2), pid_dir)
    assert took < 10
    assert isinstance(error, RunCancelledError)
    assert "the run was cancelled; every rank was ended" in str(error)
    assert_all_gone(pids, within=1)


def test_an_interrupted_driver_ends_its_ranks(pid_dir):
    """A KeyboardInterrupt (or Airflow's execution_timeout) raised in run() leaves no rank behind."""
    import _thread

    def interrupt_when_started() -> None:
        wait_for_pids(pid_dir, 2)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_when_started).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        HorovodRunner(np=-2).run(sleep_and_record, pid_dir=pid_dir)
    assert time.monotonic() - started < 30
    assert_all_gone(wait_for_pids(pid_dir, 2, timeout=1), within=10)


def test_processes_a_rank_leaves_behind_are_ended(tmp_path):
    def leave_a_child(path: str) -> int:
        import subprocess
        import sys

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(path, "a").write(f"{child.pid}\n")
        return child.pid

    pids_file = tmp_path / "children"
    started = time.monotonic()
    HorovodRunner(np=-2).run(leave_a_child, path=str(pids_file))
    assert time.monotonic() - started < 30
    assert_all_gone([int(pid) for pid in pids_file.read_text().split()], within=5)
