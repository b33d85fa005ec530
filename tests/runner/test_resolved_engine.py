"""The manifest records what engine.device / engine.dtype resolved to when the output was
started; a resume that would resolve them differently (a CPU-started output resumed on a GPU
node) is refused with exit 5 naming what changed, --restart still starts over, and an output
written before the record existed keeps resuming."""
import json
import shutil
from types import SimpleNamespace

import pytest

from batchrun.errors import JobChanged
from batchrun.job.plan import resolve_engine
from batchrun.job.exit_codes import ExitCode, exit_code_of
from batchrun.job.run.runner import run_job
from batchrun.job.jobfile.spec import load_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows

AUTO = {"device": "auto", "dtype": "auto", "max_model_len": 128, "max_num_seqs": 8}


def run(job, logs=None, **kw):
    return run_job(load_job(job), progress=False, log=(logs.append if logs is not None else lambda m: None),
                   engine_factory=FakeEngine.from_spec, **kw)


@pytest.fixture
def bf16_model(tiny_model, tmp_path):
    """The tiny model with a config that names bfloat16 (as most released checkpoints do)."""
    model = tmp_path / "bf16"
    shutil.copytree(tiny_model["model"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(cfg))
    return str(model)


def gpu_node(monkeypatch, visible: bool = True):
    monkeypatch.setattr(resolve_engine, "cuda_available", lambda: visible)


def manifest(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "_batchrun" / "manifest.json").read_text())


def test_resume_on_a_node_that_resolves_differently_is_refused(make_job, bf16_model, tmp_path, monkeypatch):
    job = make_job(demo_rows(8), model=bf16_model, engine=AUTO)
    gpu_node(monkeypatch, False)
    run(job)
    assert manifest(tmp_path)["engine_resolved"] == {"device": "cpu", "dtype": "float32", "quantization": "none"}
    parts = sorted(p.name for p in (tmp_path / "out").glob("part-*.parquet"))

    gpu_node(monkeypatch)
    with pytest.raises(JobChanged) as e:
        run(job)
    msg = str(e.value)
    assert ("engine.device resolved to cuda on this node, the output was started with cpu; "
            "engine.dtype resolved to bfloat16 on this node, the output was started with float32") in msg
    assert "--restart" in msg and exit_code_of(e.value) == ExitCode.JOB_CHANGED == 5
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*.parquet")) == parts  # nothing touched

    stats = run(job, restart=True)  # the way out: start over with this node's numerics
    assert stats.units_done == stats.units_total
    assert manifest(tmp_path)["engine_resolved"]["dtype"] == "bfloat16"


def test_same_resolution_resumes(make_job, bf16_model, tmp_path, monkeypatch):
    job = make_job(demo_rows(8), model=bf16_model, engine={**AUTO, "dtype": "float16"})
    gpu_node(monkeypatch)
    run(job)
    again = run(job)
    assert again.units_skipped == again.units_total


def test_output_of_an_older_version_resumes_and_gets_the_record(make_job, bf16_model, tmp_path, monkeypatch):
    job = make_job(demo_rows(8), model=bf16_model, engine=AUTO)
    gpu_node(monkeypatch, False)
    run(job)
    path = tmp_path / "out" / "_batchrun" / "manifest.json"
    old = manifest(tmp_path)
    del old["engine_resolved"]
    path.write_text(json.dumps(old))
    logs = []
    again = run(job, logs)
    assert again.units_skipped == again.units_total  # its commits are still this job's
    assert any("did not record what engine.device/dtype resolved to" in line for line in logs), logs
    assert manifest(tmp_path)["engine_resolved"]["device"] == "cpu"
    gpu_node(monkeypatch)
    with pytest.raises(JobChanged, match="engine.device resolved to cuda"):
        run(job)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_dtype_rule_is_the_loaders(device):
    import torch
    from batchrun.engine.models.loader import resolve_dtype
    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    for written in ("auto", "float32", "float16", "bfloat16"):
        for config_dtype in (None, "float32", "float16", "bfloat16"):
            cfg = SimpleNamespace(torch_dtype=config_dtype)
            want = names[resolve_dtype(written, cfg, torch.device(device))]
            assert resolve_engine.dtype_name(written, config_dtype, device) == want, (written, config_dtype)


def test_device_rule_is_the_engines(monkeypatch):
    import torch
    from batchrun.engine.engine import resolve_device
    for visible in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
        assert resolve_engine.resolve_device("auto") == resolve_device("auto").type
        assert resolve_engine.resolve_device("cpu") == resolve_device("cpu").type


def test_quantization_is_recorded_from_the_checkpoint(tiny_model, tmp_path):
    model = tmp_path / "q"
    shutil.copytree(tiny_model["model"], model)
    assert resolve_engine.weight_quantization(str(model)) == "none"
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (model / "config.json").write_text(json.dumps(cfg))
    assert resolve_engine.weight_quantization(str(model)) == "fp8"
