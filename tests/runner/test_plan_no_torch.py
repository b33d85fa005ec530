"""`plan` and the pre-run checks never import torch or transformers for plain-text prompts
(issue 11, start-up): model and adapter headers are read with a torch-free safetensors header
reader, and prompt tokens are counted with the `tokenizers` library from tokenizer.json."""
import os
import subprocess
import sys

import pytest

import pyarrow as pa

from batchrun.job.inputs.token_count import load_counter
from tests.helpers.jobs import demo_rows, REPO

BLOCK = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
         "from batchrun.__main__ import entry; entry(sys.argv[1:])")


def test_plan_runs_where_torch_and_transformers_cannot_be_imported(make_job):
    rows = demo_rows(12)
    rows[3]["prompt"] = "x" * 200  # too long for max_model_len 128: a predicted error row
    job = make_job(rows)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", BLOCK, "plan", str(job)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "work units: 3 of up to 4 rows" in r.stdout and "reverse" in r.stdout
    with_torch = subprocess.run([sys.executable, "-m", "batchrun", "plan", str(job)], capture_output=True,
                                text=True, env=env, timeout=120)
    assert with_torch.returncode == 0 and with_torch.stdout == r.stdout


def test_a_broken_safetensors_header_is_still_refused_without_torch(make_job, tiny_model, tmp_path):
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_model["model"], model)
    with open(model / "model.safetensors", "r+b") as f:
        f.truncate(100)
    job = make_job(demo_rows(3), model=str(model))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", BLOCK, "plan", str(job)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 3 and "cannot read safetensors file" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_text_counts_equal_the_transformers_tokenizer(tiny_model, which):
    from transformers import AutoTokenizer
    model = tiny_model["model"] if which == "tiny" else str(REPO / "demo" / "model")
    if not os.path.isfile(os.path.join(model, "tokenizer.json")):
        pytest.skip("no demo model here")
    texts = ["hello world", "  leading and trailing  ", "Ünïcödé ✓ text", "a" * 300, "x", "tab\there\nnew line",
             "?!.,;:'-", "MiXeD CaSe 123"]
    fast = load_counter(model, messages=False).lengths(pa.array(texts)).tolist()
    hf = [len(ids) for ids in AutoTokenizer.from_pretrained(model)(texts)["input_ids"]]
    assert fast == hf
