"""What --restart may delete, which output.path values are refused, verified resume, and inputs
pinned to the plan (issue 9, cases 2, 3, 4, 11)."""
import json
import os
import shutil

import pytest

from batchrun.cli import ExitCode
from batchrun.errors import ConfigError, InputChanged
from batchrun.job.jobfile.spec import load_job
from batchrun.job.run.runner import run_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.faults import assert_every_id_once, commits, N_ROWS, wait_for
from tests.helpers.jobs import demo_rows, fork_cli, run_cli, write_rows


def run(job, restart=False):
    return run_job(load_job(job), restart=restart, engine_factory=FakeEngine.from_spec, progress=False,
                   log=lambda m: None)


# ---- what --restart deletes, and which output.path is refused ------------------------------------

def test_restart_deletes_only_its_own_parts(make_job, tmp_path):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    run(job)
    (out / "part-mine.parquet").write_bytes(b"mine")
    (out / "part-999999.parquet").write_bytes(b"not a unit of this plan")
    (out / "readme.md").write_text("mine too")
    run(job, restart=True)
    assert (out / "part-mine.parquet").read_bytes() == b"mine"
    assert (out / "part-999999.parquet").read_bytes() == b"not a unit of this plan"
    assert (out / "readme.md").read_text() == "mine too"
    assert_every_id_once(out, extra_ok=("part-mine.parquet", "part-999999.parquet", "readme.md"))


def test_output_equal_to_input_folder_is_refused_and_inputs_kept(make_job, tmp_path):
    first = make_job(demo_rows(N_ROWS))
    run(first)  # its output out/ becomes the next job's input
    before = sorted(os.listdir(tmp_path / "out"))
    job = make_job(demo_rows(N_ROWS), job_name="second.yaml",
                   input={"path": "out", "prompt_column": "output_text", "adapter_column": None},
                   adapters=None, output={"path": "out"})
    for restart in (False, True):
        with pytest.raises(ConfigError, match="output.path: .* (is inside|is a parent of|contains)"):
            run(job, restart=restart)
    assert sorted(os.listdir(tmp_path / "out")) == before


@pytest.mark.parametrize("where", ["inside_input", "parent_of_input", "glob_match"])
def test_output_overlapping_the_input_is_refused(make_job, tmp_path, where):
    over = {"inside_input": {"output": {"path": "data/out"}},
            "parent_of_input": {"output": {"path": "."}},
            "glob_match": {"input": {"path": "data/**/*.parquet"}, "output": {"path": "data/out"}}}[where]
    job = make_job(demo_rows(6), **over)
    with pytest.raises(ConfigError, match="output.path"):
        run(job)
    r = run_cli("plan", job)  # plan runs the same checks
    assert r.returncode == ExitCode.CONFIG and "batchrun: error: output.path" in r.stderr


def test_output_next_to_input_file_and_outside_a_glob_are_fine(make_job, tmp_path):
    job = make_job(demo_rows(6), input={"path": "data/in.parquet"}, output={"path": "data/out"})
    run(job)
    assert_every_id_once(tmp_path / "data" / "out", 6)
    job = make_job(demo_rows(6), input={"path": "data/*.parquet"}, output={"path": "data/out2"})
    run(job)
    assert_every_id_once(tmp_path / "data" / "out2", 6)


def test_root_and_home_are_refused(make_job, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "part-mine.parquet").write_bytes(b"mine")
    for path, needle in (("/", "output.path: / is not"), (str(tmp_path / "home"), "your home directory"),
                         ("~", "your home directory"), (str(tmp_path), "a parent of your home")):
        job = make_job(demo_rows(6), output={"path": path})
        for restart in (False, True):
            with pytest.raises(ConfigError, match=needle):
                run(job, restart=restart)
    assert (tmp_path / "home" / "part-mine.parquet").read_bytes() == b"mine"


def test_symlinked_metadata_dir_is_refused_and_its_target_untouched(make_job, tmp_path):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    run(job)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(out / "_batchrun"), elsewhere)
    os.symlink(elsewhere, out / "_batchrun")
    listing = sorted(os.listdir(elsewhere))
    for restart in (False, True):
        with pytest.raises(ConfigError, match="_batchrun is a symlink"):
            run(job, restart=restart)
    assert sorted(os.listdir(elsewhere)) == listing


def test_a_foreign_non_empty_directory_is_refused(make_job, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("years of work")
    job = make_job(demo_rows(6))
    for restart in (False, True):
        with pytest.raises(ConfigError, match="is not empty and does not hold a batchrun job"):
            run(job, restart=restart)
    assert os.listdir(tmp_path / "out") == ["thesis.tex"]


# ---- verified resume ---------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncate", "remove", "flip_byte", "corrupt_marker", "replace_with_link"])
def test_damaged_part_is_reported_and_rewritten(make_job, tmp_path, damage):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    run(job)
    part = out / "part-000003.parquet"
    if damage == "truncate":
        os.truncate(part, 100)
    elif damage == "remove":
        os.remove(part)
    elif damage == "flip_byte":
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))
    elif damage == "corrupt_marker":
        (out / "_batchrun" / "commits" / "unit-000003.json").write_text("{not json")
    else:
        shutil.copy(part, tmp_path / "copy.parquet")
        os.remove(part)
        os.symlink(tmp_path / "copy.parquet", part)
    r = run_cli("status", out)
    assert r.returncode == ExitCode.DAMAGED and "damaged: 1 committed unit(s)" in r.stdout and "incomplete" in r.stdout
    r = run_cli("verify", out)
    assert r.returncode == ExitCode.DAMAGED and "unit 3:" in r.stdout, r.stdout
    stats = run(job)
    assert stats.units_repaired == 1 and stats.units_done == 1 and stats.units_skipped == 8
    assert_every_id_once(out)
    r = run_cli("verify", out)
    assert r.returncode == 0 and "verified: 9/9 units (30 rows)" in r.stdout
    r = run_cli("status", out)
    assert "damaged:" not in r.stdout and r.stdout.rstrip().endswith("complete")


def test_touch_without_change_is_not_damage(make_job, tmp_path):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    run(job)
    os.utime(out / "part-000002.parquet", ns=(1, 1))  # mtime moved: sha256 is rechecked, matches
    assert run(job).units_skipped == 9


# ---- inputs pinned to the plan -----------------------------------------------------------------

@pytest.mark.parametrize("change", ["same_length", "shorter", "deleted"])
def test_input_changed_during_run_stops_with_exit_5(make_job, tmp_path, change):
    files = {"a.parquet": demo_rows(12), "b.parquet": demo_rows(18, start=12)}
    job = make_job(files=files, input={"rows_per_unit": 2})
    out = tmp_path / "out"
    proc = fork_cli(["run", job, "--no-progress"], env={"FAKE_ENGINE_SLEEP": "0.05"})
    wait_for(lambda: len(commits(out)) >= 1)
    target = tmp_path / "data" / "b.parquet"
    if change == "deleted":
        os.remove(target)
    else:
        rows = demo_rows(18 if change == "same_length" else 5, start=12)
        for r in rows:
            r["prompt"] = "changed " + r["prompt"]
        write_rows(tmp_path / "data" / "new.tmp", rows)
        os.replace(tmp_path / "data" / "new.tmp", target)
    proc.join(60)
    assert proc.exitcode == ExitCode.JOB_CHANGED
    # everything committed came from the old contents, each id once
    from tests.helpers.faults import dataset_ids
    ids = dataset_ids(out)
    assert len(ids) == sum(json.loads((out / "_batchrun" / "commits" / c).read_text())["rows"]
                           for c in commits(out))


def test_input_change_message_names_the_file(make_job, tmp_path, monkeypatch):
    job = make_job(demo_rows(N_ROWS))
    target = tmp_path / "data" / "in.parquet"
    seen = []
    orig = FakeEngine.generate

    def generate(self, requests, on_result=None):
        if not seen:
            seen.append(1)
            write_rows(target, demo_rows(10))  # replaced after the first group was read
        return orig(self, requests, on_result)

    monkeypatch.setattr(FakeEngine, "generate", generate)
    with pytest.raises(InputChanged, match=f"input file {target} changed during the run"):
        run(job)
