"""sampling.n > 1 through the real engine: n rows per input row with sample_index, distinct samples,
identical across reruns, --num-tasks splits and resume; verify counts input rows."""
import os

import pyarrow as pa

from batchrun.job.jobfile.spec import load_job
from batchrun.job.run.runner import run_job
from batchrun.job.store.verify import verify
from tests.helpers.jobs import read_output

ROWS = [{"id": i, "prompt": p} for i, p in enumerate(["hello", "abc", "tiny model", "xyz run", "fox", "lora"])]
SAMPLING = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 8, "logprobs": 2, "stop": ["zz"]}


def same(a: dict, b: dict) -> bool:
    """Same tokens exactly; logprobs to float32 batch noise (batch-mates change the matmul shapes)."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == b[k][0], k
        assert max((abs(x - y) for x, y in zip(a[k][1], b[k][1])), default=0) < 1e-5, k
    return True


def run(job, **kw):
    return run_job(load_job(job), progress=False, log=lambda m: None, **kw)


def samples(out) -> dict:
    t = read_output(out)
    return {(r["id"], r["sample_index"]): (r["output_token_ids"], r["logprobs"]) for r in t.to_pylist()}


def test_n_samples_rows_distinct_and_reproducible(job_factory, tmp_path):
    job = job_factory(ROWS, sampling=SAMPLING, input={"passthrough_columns": ["prompt"]})
    run(job)
    out = tmp_path / "out"
    t = read_output(out)
    assert t.num_rows == 18
    names = t.schema.names
    assert names[:3] == ["id", "adapter", "sample_index"] and "stop_reason" in names
    assert names[-3:] == ["logprobs", "top_logprobs", "prompt"]
    assert t.schema.field("top_logprobs").type == pa.list_(pa.list_(pa.struct(
        [("token_id", pa.int32()), ("logprob", pa.float32())])))
    got = samples(out)
    assert sorted(got) == [(i, k) for i in range(6) for k in range(3)]
    for i in range(6):
        assert len({tuple(got[(i, k)][0]) for k in range(3)}) > 1, f"row {i}: samples are all the same"
        assert all(len(got[(i, k)][1]) == len(got[(i, k)][0]) for k in range(3))
    text, ok = verify(str(out))
    assert ok and "(6 rows)" in text, text

    # split over two tasks, into another directory: same samples
    split = job_factory(ROWS, sampling=SAMPLING, input={"passthrough_columns": ["prompt"]}, output={"path": "out2"},
                        job_name="split.yaml")
    run(split, task_id=1, num_tasks=2)
    run(split, task_id=0, num_tasks=2)
    assert same(samples(tmp_path / "out2"), got)

    # resume after losing a committed unit: rewritten identically
    os.remove(out / "_batchrun" / "commits" / "unit-000001.json")
    stats = run(job)
    assert stats.units_done == 1
    assert same(samples(out), got)


def test_sample_zero_keeps_the_n1_seed(job_factory, tmp_path):
    one = {**SAMPLING, "n": 1}
    run(job_factory(ROWS, sampling=one, output={"path": "one"}))
    single = {r["id"]: r["output_token_ids"] for r in read_output(tmp_path / "one").to_pylist()}
    run(job_factory(ROWS, sampling=SAMPLING, output={"path": "three"}))
    three = samples(tmp_path / "three")
    assert all(three[(i, 0)][0] == single[i] for i in single)
