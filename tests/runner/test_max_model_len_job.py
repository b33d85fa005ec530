"""engine.max_model_len: auto on the job side: plan prints and checks against the model's
context; the fingerprint hashes the resolved value, so an output started with the old default
2048 resumes under auto when the model's context is 2048 and is refused, naming the value that
resumes it, when it is not."""
import json
import shutil

import pytest
import yaml

from batchrun.errors import ConfigError, JobChanged
from batchrun.job.exit_codes import ExitCode, exit_code_of
from batchrun.job.jobfile.spec import load_job
from batchrun.job.report import plan_report
from batchrun.job.run.runner import run_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows, read_output


def run(job, **kw):
    return run_job(load_job(job), progress=False, log=lambda m: None, engine_factory=FakeEngine.from_spec, **kw)


def with_context(tiny_model, tmp_path, context: int) -> str:
    """The tiny model with config.json's max_position_embeddings set to ``context``."""
    model = tmp_path / f"ctx{context}"
    shutil.copytree(tiny_model["model"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (model / "config.json").write_text(json.dumps(cfg))
    return str(model)


def set_len(job, value) -> None:
    """Set engine.max_model_len in the job file (None: leave it out, i.e. auto)."""
    raw = yaml.safe_load(job.read_text())
    raw["engine"].pop("max_model_len", None)
    if value is not None:
        raw["engine"]["max_model_len"] = value
    job.write_text(yaml.safe_dump(raw, sort_keys=False))


def test_plan_prints_the_models_context_and_counts_error_rows_with_it(make_job, tiny_model):
    rows = demo_rows(6)
    rows[0]["prompt"] = "x" * 300  # the tiny model's context is 256
    job = make_job(rows)
    set_len(job, None)
    out = plan_report(load_job(job), 1)
    assert ("max_model_len=auto (256: the model's context; lowered when the engine starts if its KV cache "
            "holds less for one sequence)") in out
    assert "predicted error rows: 1 of 6" in out


def test_a_run_without_max_model_len_uses_the_context(make_job, tiny_model, tmp_path):
    rows = demo_rows(6)
    rows[0]["prompt"] = "x" * 300
    job = make_job(rows)
    set_len(job, None)
    run(job)
    table = read_output(tmp_path / "out").to_pylist()
    errors = [r["error"] for r in table if r["error"]]
    assert errors == ["prompt has 302 tokens; with max_tokens 24 that exceeds engine.max_model_len 256"]


def test_an_explicit_value_over_the_context_is_refused_at_plan(make_job):
    job = make_job(demo_rows(3))
    set_len(job, 512)
    with pytest.raises(ConfigError, match=r"engine.max_model_len: 512 is longer than the model's context "
                                          r"\(max_position_embeddings 256"):
        plan_report(load_job(job), 1)


def test_max_tokens_is_checked_against_the_context(make_job):
    job = make_job(demo_rows(3), sampling={"max_tokens": 256})
    set_len(job, None)
    with pytest.raises(ConfigError, match=r"sampling.max_tokens: must be smaller than engine.max_model_len "
                                          r"\(256, auto: the model's context\)"):
        plan_report(load_job(job), 1)


def test_old_default_resumes_under_auto_when_the_context_is_2048(make_job, tiny_model, tmp_path):
    job = make_job(demo_rows(8), model=with_context(tiny_model, tmp_path, 2048))
    set_len(job, 2048)  # what a job file without max_model_len meant before auto
    run(job)
    set_len(job, None)
    again = run(job)
    assert again.units_skipped == again.units_total  # same limit, same fingerprint


def test_old_default_under_auto_with_another_context_is_refused_naming_the_fix(make_job, tiny_model, tmp_path):
    job = make_job(demo_rows(8), model=with_context(tiny_model, tmp_path, 4096))
    set_len(job, 2048)
    run(job)
    set_len(job, None)
    with pytest.raises(JobChanged) as e:
        run(job)
    msg = str(e.value)
    assert "engine.device / engine.dtype / engine.max_model_len" in msg
    assert ("It was started with engine.max_model_len 2048 (2048 was the default before auto); this job's "
            "is auto, which is the model's context 4096. Set engine.max_model_len: 2048 to resume it.") in msg
    assert "--restart" in msg and exit_code_of(e.value) == ExitCode.JOB_CHANGED
    set_len(job, 2048)  # the fix the message names
    again = run(job)
    assert again.units_skipped == again.units_total
