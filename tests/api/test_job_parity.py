"""A prompt given a job row's id (request_ids, or a prompt dict's "id") and the job's sampling
settings gets exactly that row's tokens: a notebook reproduces a row of the nightly job. The rows
are sampled (temperature 1), so each row's tokens depend on the seed derived from its id."""
import pytest

import batchrun
from batchrun.errors import ConfigError
from batchrun.job.run.runner import run_job
from batchrun.job.jobfile.spec import load_job
from tests.helpers.jobs import read_output, write_job, write_rows

SAMPLING = {"max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 2}
PROMPTS = {100: "hello there", 205: "the quick fox", 317: "abc xyz", 452: "hello there"}
CONVS = {"a": [{"role": "user", "content": "hi"}],
         "b": [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "what is lora"}],
         "c": [{"role": "user", "content": "hi"}]}


def _job(tmp_path, char_model, rows, inp) -> dict:
    write_rows(tmp_path / "in.parquet", rows)
    job = write_job(tmp_path / "job.yaml", {
        "model": char_model, "input": {"path": "in.parquet", "id_column": "id", "rows_per_unit": 2, **inp},
        "output": {"path": "out"}, "sampling": SAMPLING,
        "engine": {"device": "cpu", "max_model_len": 128, "max_num_seqs": 8}})
    run_job(load_job(job), progress=False, log=lambda m: None)
    got: dict = {}
    for r in read_output(tmp_path / "out").to_pylist():
        got.setdefault(r["id"], {})[r["sample_index"]] = r["output_token_ids"]
    return {i: [s[k] for k in sorted(s)] for i, s in got.items()}


def _tokens(outputs) -> dict:
    return {o.request_id: [c.token_ids for c in o.outputs] for o in outputs}


def test_request_ids_reproduce_the_jobs_sampled_rows(tmp_path, char_model, char_llm):
    job = _job(tmp_path, char_model, [{"id": i, "prompt": p} for i, p in PROMPTS.items()], {"prompt_column": "prompt"})
    assert job[100] != job[452]  # same prompt, other id: other seed (the test can tell ids apart)
    ids = [452, 317, 100, 205]  # another order than the job's, and other positions
    sp = batchrun.SamplingParams(**SAMPLING)
    by_ids = char_llm.generate([PROMPTS[i] for i in ids], sp, request_ids=ids, use_tqdm=False)
    assert _tokens(by_ids) == job
    as_dicts = char_llm.generate([{"prompt": PROMPTS[i], "id": i} for i in ids], SAMPLING, use_tqdm=False)
    assert _tokens(as_dicts) == job
    import numpy as np  # numpy ids (a pandas column) seed as the plain ints the job reads
    assert _tokens(char_llm.generate([PROMPTS[i] for i in ids], sp, request_ids=list(np.array(ids)),
                                     use_tqdm=False)) == job
    alone = char_llm.generate(PROMPTS[205], sp, request_ids=[205], use_tqdm=False)
    assert _tokens(alone)[205] == job[205]  # batch-mates do not matter either


def test_chat_with_request_ids_reproduces_the_jobs_messages_rows(tmp_path, char_model, char_llm):
    rows = [{"id": i, "messages": m} for i, m in CONVS.items()]
    job = _job(tmp_path, char_model, rows, {"prompt_column": None, "messages_column": "messages"})
    assert job["a"] != job["c"]
    ids = ["c", "a", "b"]
    out = char_llm.chat([CONVS[i] for i in ids], batchrun.SamplingParams(**SAMPLING), request_ids=ids, use_tqdm=False)
    assert _tokens(out) == job


def test_request_id_mistakes_are_clear(char_llm):
    with pytest.raises(ConfigError, match=r"request_ids: 1 ids for 2 prompt\(s\)"):
        char_llm.generate(["a", "b"], request_ids=[1], use_tqdm=False)
    with pytest.raises(ConfigError, match="request ids: 3 is given to prompts 0 and 1"):
        char_llm.generate(["a", "b"], request_ids=[3, 3], use_tqdm=False)
    with pytest.raises(ConfigError, match=r"request_ids\[0\]: a request id must be an integer or a string"):
        char_llm.generate(["a"], request_ids=[1.5], use_tqdm=False)
    with pytest.raises(ConfigError, match=r"prompts\[1\]: has no id while other prompts have one"):
        char_llm.generate([{"prompt": "a", "id": 1}, "b"], use_tqdm=False)
    with pytest.raises(ConfigError, match="the prompts carry ids already"):
        char_llm.generate([{"prompt": "a", "id": 1}], request_ids=[1], use_tqdm=False)
    with pytest.raises(ConfigError, match=r"prompts\[0\]: key 'multi_modal_data' is not supported"):
        char_llm.generate([{"prompt": "a", "multi_modal_data": {}}], use_tqdm=False)
