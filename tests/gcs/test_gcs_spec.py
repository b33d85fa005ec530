"""gs:// paths without a server: Google's credential chain and the missing extra, each named."""
from __future__ import annotations

import pytest

from tests.helpers.jobs import run_cli_without


def test_a_gs_input_without_credentials_names_the_gcloud_fix(monkeypatch, tmp_path, tiny_model):
    pytest.importorskip("google.cloud.storage")
    from batchrun.job.inputs.files import find_input_files
    from batchrun.job.jobfile.spec import parse_job
    from batchrun.job.storage.errors import StorageError
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    spec = parse_job({"model": tiny_model["model"], "input": {"path": "gs://bucket/prompts/", "id_column": "id",
                      "prompt_column": "prompt"}, "output": {"path": "out"}}, str(tmp_path))
    with pytest.raises(StorageError, match=r"input.path: gs://bucket/prompts/: NoCredentials: .*missing.json.*"
                                           r"gcloud auth application-default login"):
        find_input_files(spec.input)


@pytest.mark.slow
def test_without_google_cloud_storage_a_gs_path_names_the_extra():
    r = run_cli_without(("google",), "status", "gs://bucket/runs/o", timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "gs:// paths need google-cloud-storage" in r.stderr and "pip install 'batchrun[gcs]'" in r.stderr, r.stderr
