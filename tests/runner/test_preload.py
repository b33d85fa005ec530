"""`batchrun run` imports the engine side on a background thread (batchrun/common/preload.py, issue 11):
errors there reach the main thread with their own type when it needs the module, a job that
fails its checks exits without waiting for the imports, and the run itself is unchanged."""
import importlib
import shutil
import threading

import pytest

from batchrun.common import preload
from tests.helpers.jobs import demo_rows, read_output, run_cli, run_cli_without


@pytest.fixture
def fresh_preload():
    importlib.reload(preload)
    yield preload
    try:
        preload.wait()  # let the test's thread finish before the module is reset
    except Exception:
        pass
    importlib.reload(preload)


def test_steps_run_in_order_off_the_main_thread_and_errors_keep_their_type(fresh_preload):
    seen = []
    fresh_preload.start(modules=())
    fresh_preload.then(lambda: seen.append(threading.current_thread().name))
    fresh_preload.wait()
    assert seen == ["batchrun-preload"]

    def broken():
        raise KeyError("step failed")

    fresh_preload.then(broken)
    fresh_preload.then(lambda: seen.append("after the error"))
    with pytest.raises(KeyError, match="step failed"):
        fresh_preload.wait()
    with pytest.raises(KeyError):  # every later wait says it again
        fresh_preload.wait()
    assert seen == ["batchrun-preload"]  # steps after a failed one are skipped


def test_wait_without_start_does_nothing(fresh_preload, monkeypatch):
    fresh_preload.then(lambda: 1 / 0)
    fresh_preload.wait()
    monkeypatch.setenv("BATCHRUN_PRELOAD", "0")
    fresh_preload.start()
    assert fresh_preload._thread is None


def _blocked_run(blocked: str, job, timeout=180):
    return run_cli_without(tuple(blocked.split(",")), "run", job, "--progress", "none", timeout=timeout)


def test_a_failing_torch_import_surfaces_before_anything_is_written(make_job, tmp_path):
    r = _blocked_run("torch", make_job(demo_rows(8)))
    assert r.returncode == 1, r.stderr
    assert "ImportError: torch is blocked in this test" in r.stderr
    assert "batchrun: error: internal error" in r.stderr
    assert not (tmp_path / "out" / "_batchrun" / "manifest.json").exists()


@pytest.mark.slow
def test_a_broken_tokenizer_loaded_in_the_background_is_a_config_error(make_job, tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model["model"], model)
    (model / "tokenizer.json").write_text("{not json")
    r = run_cli("run", make_job(demo_rows(8), model=str(model)), fake=False)
    assert r.returncode == 3, r.stderr
    assert "cannot load the tokenizer" in r.stderr and "Traceback" not in r.stderr


def test_a_bad_job_exits_with_its_config_error_while_imports_run(make_job, tmp_path):
    r = run_cli("run", make_job(demo_rows(8), model=str(tmp_path / "missing")), fake=False, timeout=60)
    assert r.returncode == 3 and "is not a directory" in r.stderr, r.stderr


@pytest.mark.slow
def test_runs_with_and_without_the_preload_write_the_same_rows(make_job, tmp_path):
    job = make_job(demo_rows(12))
    tables = []
    for flag in ("1", "0"):
        r = run_cli("run", job, "--restart", "--progress", "none", env={"BATCHRUN_PRELOAD": flag}, fake=False)
        assert r.returncode == 0, r.stderr
        assert "waiting for imports" in r.stderr
        tables.append(sorted((row["id"], row["output_text"]) for row in read_output(tmp_path / "out").to_pylist()))
    assert tables[0] == tables[1]


def test_a_forked_child_starts_its_own_preload(fresh_preload):
    """The parent's preload thread does not exist in a fork: the child starts afresh instead of
    waiting on the parent's queue forever."""
    import multiprocessing
    fresh_preload.start(modules=("json",))
    fresh_preload.wait()

    def child():
        fresh_preload.start(modules=("json",))
        fresh_preload.then(lambda: None)
        fresh_preload.wait()
    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join(30)
    assert p.exitcode == 0, "the forked child's preload hung" if p.exitcode is None else p.exitcode
