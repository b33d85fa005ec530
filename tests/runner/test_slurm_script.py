"""`batchrun slurm --signal-before S`: the script's SIGTERM margin, checked against --time."""
import pytest
from click.testing import CliRunner

from batchrun.cli import ExitCode, main
from batchrun.errors import ConfigError
from batchrun.job.launch.slurm import time_limit_s
from tests.helpers.jobs import demo_rows


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_default_signal_is_120_s_before_the_limit(make_job, tmp_path):
    job = make_job(demo_rows(3))
    r = cli("slurm", job, "--array", "2")
    assert r.exit_code == 0, r.output
    assert "#SBATCH --signal=B:TERM@120\n" in (tmp_path / "job.sbatch").read_text()


def test_signal_before_sets_the_margin(make_job, tmp_path):
    job = make_job(demo_rows(3))
    r = cli("slurm", job, "--array", "2", "--time", "1", "--signal-before", "45")
    assert r.exit_code == 0, r.output
    text = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --signal=B:TERM@45\n" in text and "#SBATCH --time=1\n" in text
    assert "@120" not in text and "45 s before the time limit" in text


@pytest.mark.parametrize("args, message", [
    (["--time", "1", "--signal-before", "60"], "--signal-before 60 s is not shorter than --time 1 (60 s)"),
    (["--signal-before", "-1"], "--signal-before must be 0..65535 seconds"),
    (["--signal-before", "70000", "--time", "30-0"], "--signal-before must be 0..65535 seconds"),
    (["--time", "soon"], "--time: 'soon' is not a Slurm time limit"),
])
def test_bad_signal_before_or_time_is_a_config_error(make_job, tmp_path, args, message):
    job = make_job(demo_rows(3))
    r = cli("slurm", job, "--array", "2", *args)
    assert r.exit_code == ExitCode.CONFIG and message in r.output, r.output
    assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("value, seconds", [
    ("1", 60), ("90", 5400), ("2:30", 150), ("2:00:00", 7200), ("1-0", 86400), ("1-2", 93600),
    ("1-2:3", 93780), ("1-2:3:4", 93784), ("UNLIMITED", None), ("infinite", None)])
def test_slurm_time_formats(value, seconds):
    assert time_limit_s(value) == seconds


@pytest.mark.parametrize("value", ["", "1:2:3:4", "-5", "a-1", "1:-1"])
def test_bad_slurm_times(value):
    with pytest.raises(ConfigError, match="is not a Slurm time limit"):
        time_limit_s(value)
