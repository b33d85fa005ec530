"""input.path: a directory and the glob DIR/**/*.parquet find the same files (input_files.py's
rule), and what neither may skip silently is refused with the path named."""
import os

import pyarrow.dataset as ds
import pytest

from batchrun.errors import ConfigError
from batchrun.job.inputs.files import find_input_files
from batchrun.job.jobfile.spec import parse_job
from tests.helpers.jobs import write_rows


def found(tmp_path, path):
    spec = parse_job({"model": "m", "input": {"path": path, "prompt_column": "prompt"},
                      "output": {"path": "out"}}, base_dir=tmp_path)
    files, root = find_input_files(spec.input)
    return [os.path.relpath(f, root) for f in files]


def both(tmp_path):
    """(directory input, DIR/**/*.parquet glob): asserted equal, returned once."""
    by_dir = found(tmp_path, "data")
    assert found(tmp_path, "data/**/*.parquet") == by_dir
    return by_dir


def put(path, n=1):
    write_rows(path, [{"prompt": "x"}] * n)


def test_symlinked_subdirectory_is_read_as_pyarrow_reads_it(tmp_path):
    put(tmp_path / "data" / "a.parquet")
    put(tmp_path / "elsewhere" / "b.parquet", 3)
    os.symlink(tmp_path / "elsewhere", tmp_path / "data" / "linked")
    assert both(tmp_path) == ["a.parquet", os.path.join("linked", "b.parquet")]
    assert ds.dataset(str(tmp_path / "data"), format="parquet").count_rows() == 4  # pyarrow agrees


def test_symlinked_file_is_read(tmp_path):
    put(tmp_path / "data" / "a.parquet")
    put(tmp_path / "elsewhere" / "b.parquet")
    os.symlink(tmp_path / "elsewhere" / "b.parquet", tmp_path / "data" / "b.parquet")
    assert both(tmp_path) == ["a.parquet", "b.parquet"]


def test_hidden_and_underscore_names_skipped_by_both_unless_written_out(tmp_path):
    for name in ("a.parquet", "_b.parquet", ".c.parquet", "_tmp/d.parquet", ".git/e.parquet", "sub/f.parquet",
                 "sub/_g.parquet"):
        put(tmp_path / "data" / name)
    assert both(tmp_path) == ["a.parquet", os.path.join("sub", "f.parquet")]
    assert found(tmp_path, "data/*") == ["a.parquet"]  # wildcards skip them too (not glob.glob: _b)
    assert found(tmp_path, "data/_tmp/*.parquet") == ["d.parquet"]  # written out: used
    assert found(tmp_path, "data/_*.parquet") == ["_b.parquet"]  # a pattern that asks for them


def test_non_parquet_files_and_extension_case(tmp_path):
    put(tmp_path / "data" / "a.parquet")
    (tmp_path / "data" / "README.md").write_text("notes")
    assert both(tmp_path) == ["a.parquet"]
    put(tmp_path / "data" / "sub" / "B.PARQUET")
    for path in ("data", "data/**/*.parquet"):
        with pytest.raises(ConfigError, match=r"input.path: .*sub/B.PARQUET is named like an input but for the "
                                              r"case of its extension \('.PARQUET'.*rename it"):
            found(tmp_path, path)
    assert found(tmp_path, "data/**/*.PARQUET") == [os.path.join("sub", "B.PARQUET")]


def test_order_is_by_path_for_both(tmp_path):
    for name in ("b/x.parquet", "a.parquet", "a/z.parquet", "B.parquet", "a-b.parquet"):
        put(tmp_path / "data" / name)
    assert both(tmp_path) == sorted(["b/x.parquet", "a.parquet", "a/z.parquet", "B.parquet", "a-b.parquet"])


def test_symlink_loop_is_refused_naming_the_link(tmp_path):
    put(tmp_path / "data" / "sub" / "a.parquet")
    os.symlink(tmp_path / "data", tmp_path / "data" / "sub" / "back")
    for path in ("data", "data/**/*.parquet"):
        with pytest.raises(ConfigError, match=r"input.path: .*data/sub/back is a symlink back to a directory it is in"):
            found(tmp_path, path)


def test_same_file_through_two_links_is_refused(tmp_path):
    put(tmp_path / "shared" / "a.parquet")
    os.makedirs(tmp_path / "data")
    os.symlink(tmp_path / "shared", tmp_path / "data" / "one")
    os.symlink(tmp_path / "shared", tmp_path / "data" / "two")
    with pytest.raises(ConfigError, match=r"one/a.parquet and .*two/a.parquet are the same file .*rows twice"):
        found(tmp_path, "data")


def test_broken_symlink_is_refused_not_skipped(tmp_path):
    put(tmp_path / "data" / "a.parquet")
    os.symlink(tmp_path / "gone.parquet", tmp_path / "data" / "b.parquet")
    for path in ("data", "data/*.parquet"):
        with pytest.raises(ConfigError, match=r"input.path: .*data/b.parquet is a broken symlink"):
            found(tmp_path, path)


def test_unlistable_directory_is_refused_not_skipped(tmp_path, monkeypatch):
    put(tmp_path / "data" / "a.parquet")
    put(tmp_path / "data" / "locked" / "b.parquet")

    def denied(real):  # chmod 0 does not stop root, who runs the tests in some containers
        def call(d="."):
            if os.path.basename(os.fspath(d)) == "locked":
                raise PermissionError(13, "Permission denied", os.fspath(d))
            return real(d)
        return call

    monkeypatch.setattr(os, "listdir", denied(os.listdir))
    monkeypatch.setattr(os, "scandir", denied(os.scandir))
    for path in ("data", "data/**/*.parquet"):
        with pytest.raises(ConfigError, match=r"cannot list the input directory .*locked \(Permission denied\)"):
            found(tmp_path, path)


def test_run_reads_the_rows_under_a_symlinked_subdirectory(make_job, tmp_path):
    from batchrun.job.run.runner import run_job
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.store.verify import verify
    from tests.helpers.fake_engine import FakeEngine
    from tests.helpers.jobs import demo_rows, read_output
    job = make_job(demo_rows(6))
    write_rows(tmp_path / "elsewhere" / "more.parquet", demo_rows(5, start=6))
    os.symlink(tmp_path / "elsewhere", tmp_path / "data" / "linked")
    run_job(load_job(job), progress=False, log=lambda m: None, engine_factory=FakeEngine.from_spec)
    assert sorted(read_output(tmp_path / "out").column("id").to_pylist()) == list(range(11))
    assert verify(str(tmp_path / "out"))[1]


def test_output_inside_a_symlinked_input_subdirectory_is_refused(make_job, tmp_path):
    from batchrun.job.store.safe_path import check_output_path
    from batchrun.job.jobfile.spec import load_job
    from tests.helpers.jobs import demo_rows
    job = make_job(demo_rows(3), output={"path": "elsewhere/out"})
    put(tmp_path / "elsewhere" / "b.parquet")
    os.symlink(tmp_path / "elsewhere", tmp_path / "data" / "linked")
    spec = load_job(job)
    files, _ = find_input_files(spec.input)
    with pytest.raises(ConfigError, match=r"output.path: .*elsewhere/out lies inside .*elsewhere, which input.path "
                                          r".*data reads \(through a symlink\)"):
        check_output_path(spec, files)
