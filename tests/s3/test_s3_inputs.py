"""Inputs in S3 (against the session's moto server): the same discovery rule as local paths,
schemas and rows read from objects, pins by ETag."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchrun.errors import ConfigError, InputChanged
from batchrun.job.inputs.files import RowReader, check_schemas, find_input_files
from batchrun.job.inputs.pins import InputPins, identity
from batchrun.job.jobfile.spec import parse_job
from batchrun.job.plan.units import make_plan
from batchrun.job.storage.errors import StorageError
from tests.helpers.jobs import demo_rows


def spec_for(path: str, tiny_model, **inp):
    raw = {"model": tiny_model["model"],
           "input": {"path": path, "id_column": "id", "prompt_column": "prompt", "rows_per_unit": 4, **inp},
           "output": {"path": "out"}, "engine": {"device": "cpu", "max_model_len": 128}}
    return parse_job(raw, "/tmp")


def test_prefix_reads_parquet_below_it_like_a_directory(s3, tiny_model):
    for key in ["in/a.parquet", "in/sub/b.parquet", "in/_SUCCESS", "in/_tmp/c.parquet", "in/.x/d.parquet",
                "in/notes.txt", "input2/e.parquet"]:
        s3.put_rows(key, demo_rows(2))
    s3.client.put_object(Bucket=s3.name, Key="in/empty-folder/", Body=b"")
    for written in (s3.uri("in"), s3.uri("in/")):
        files, root = find_input_files(spec_for(written, tiny_model).input)
        assert files == [s3.uri("in/a.parquet"), s3.uri("in/sub/b.parquet")]
        assert root == s3.uri("in")


def test_globs_mean_what_they_mean_locally(s3, tiny_model):
    for key in ["g/x1.parquet", "g/x2.parquet", "g/y.parquet", "g/d/x3.parquet", "g/_x4.parquet",
                "g/d/e/x5.parquet"]:
        s3.put_rows(key, demo_rows(1))
    find = lambda p: find_input_files(spec_for(s3.uri(p), tiny_model).input)[0]  # noqa: E731
    assert find("g/x*.parquet") == [s3.uri("g/x1.parquet"), s3.uri("g/x2.parquet")]
    assert find("g/**/x*.parquet") == [s3.uri(k) for k in ("g/d/e/x5.parquet", "g/d/x3.parquet",
                                                            "g/x1.parquet", "g/x2.parquet")]
    assert find("g/*/x?.parquet") == [s3.uri("g/d/x3.parquet")]
    assert find("g/_x*.parquet") == [s3.uri("g/_x4.parquet")]  # a pattern starting with _ takes _ names
    _, root = find_input_files(spec_for(s3.uri("g/**/x*.parquet"), tiny_model).input)
    assert root == s3.uri("g")


def test_single_object_and_missing_paths(s3, tiny_model):
    s3.put_rows("one.parquet", demo_rows(3))
    files, root = find_input_files(spec_for(s3.uri("one.parquet"), tiny_model).input)
    assert files == [s3.uri("one.parquet")] and root == s3.uri("")[:-1]
    with pytest.raises(ConfigError, match="does not exist"):
        find_input_files(spec_for(s3.uri("nothing"), tiny_model).input)
    with pytest.raises(ConfigError, match="no objects match"):
        find_input_files(spec_for(s3.uri("*.json"), tiny_model).input)
    s3.put_rows("upper/a.PARQUET", demo_rows(1))
    with pytest.raises(ConfigError, match="case of its extension"):
        find_input_files(spec_for(s3.uri("upper/*.parquet"), tiny_model).input)


def test_plan_and_rows_from_objects_equal_the_local_files(s3, tiny_model, tmp_path):
    from tests.helpers.jobs import write_rows
    rows = demo_rows(50)
    s3.put_rows("p/a.parquet", rows[:30], row_group_size=7)
    s3.put_rows("p/b.parquet", rows[30:], row_group_size=7)
    write_rows(tmp_path / "p" / "a.parquet", rows[:30], row_group_size=7)
    write_rows(tmp_path / "p" / "b.parquet", rows[30:], row_group_size=7)
    plans = []
    for path in (s3.uri("p"), str(tmp_path / "p")):
        spec = spec_for(path, tiny_model, adapter_column="adapter")
        spec = dataclasses.replace(spec, adapters={"reverse": "/x", "upper": "/y"})
        plan = make_plan(spec)
        reader = RowReader(plan.files, ["id", "prompt", "adapter"], storage_options=spec.input.storage_options)
        got = [reader.read(*plan.unit_rows(u)) for u in plan.units]
        plans.append((plan.file_names, [(u.adapter, u.rows) for u in plan.units], got))
    assert plans[0] == plans[1]
    assert plans[0][0] == ["a.parquet", "b.parquet"]


def test_schema_problems_name_the_object(s3, tiny_model):
    s3.put_rows("s/a.parquet", [{"id": 1, "text": "x"}])
    spec = spec_for(s3.uri("s"), tiny_model)
    with pytest.raises(ConfigError, match=r"column 'prompt' is missing from s3://.*/s/a.parquet"):
        check_schemas(*[find_input_files(spec.input)[0]], spec.input)
    s3.client.put_object(Bucket=s3.name, Key="bad/x.parquet", Body=b"not parquet at all")
    spec = spec_for(s3.uri("bad"), tiny_model)
    with pytest.raises(ConfigError, match=r"s3://.*/bad/x.parquet is not a readable Parquet file"):
        check_schemas(find_input_files(spec.input)[0], spec.input)


def test_pins_notice_a_replaced_object_by_its_etag(s3):
    s3.client.put_object(Bucket=s3.name, Key="pin.parquet", Body=b"a" * 100)  # pins read no content
    uri = s3.uri("pin.parquet")
    pin = identity(uri)
    assert pin.size > 0 and pin.digest.startswith("etag:")
    pins = InputPins([uri], [pin])
    pins.check(np.array([0]))  # unchanged: passes
    s3.client.put_object(Bucket=s3.name, Key="pin.parquet", Body=b"b" * 100)  # same size: only the ETag tells
    with pytest.raises(InputChanged, match="ETag went from"):
        pins.check(np.array([0]))
    s3.client.delete_object(Bucket=s3.name, Key="pin.parquet")
    with pytest.raises(InputChanged, match="can no longer be read"):
        pins.check(np.array([0]))


def test_missing_bucket_names_the_uri(s3, tiny_model):
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-here/in: NoSuchBucket"):
        find_input_files(spec_for("s3://no-such-bucket-here/in", tiny_model).input)
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-here/x.parquet: NoSuchBucket"):
        find_input_files(spec_for("s3://no-such-bucket-here/x.parquet", tiny_model).input)


def test_bad_credentials_name_the_uri(s3, s3_auth, tiny_model, monkeypatch):
    s3.put_rows("c/a.parquet", demo_rows(2))
    spec = spec_for(s3.uri("c"), tiny_model)
    files, _ = find_input_files(spec.input)  # the right key works (the server checks keys now)
    assert check_schemas(files, spec.input).id_type is not None
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEYTHESERVERKNOWS")
    with pytest.raises(StorageError, match=rf"s3://{s3.name}/c: InvalidAccessKeyId"):
        find_input_files(spec.input)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-wrong-secret")
    with pytest.raises(StorageError, match=rf"s3://{s3.name}/c: SignatureDoesNotMatch"):
        find_input_files(spec.input)
    with pytest.raises(StorageError, match=rf"s3://{s3.name}/c/a.parquet: (SignatureDoesNotMatch|AccessDenied)"):
        check_schemas(files, spec.input)  # through pyarrow's reader too


def test_throttling_5xx_and_resets_are_retried(s3, tiny_model, monkeypatch):
    """Through a proxy that answers SlowDown / InternalError / drops the connection to the first
    requests: discovery (boto3) and the Parquet reads (pyarrow) retry and get the same rows."""
    from tests.s3.faulty_proxy import FaultyProxy
    rows = demo_rows(20)
    s3.put_rows("t/a.parquet", rows, row_group_size=5)
    spec = spec_for(s3.uri("t"), tiny_model)
    want = make_plan(spec)
    pattern = ["503", "500", "reset", "503"]
    faults = {n: pattern[(n // 2) % 4] for n in range(1, 40, 2)}  # every other request of the first 40
    with FaultyProxy(s3.endpoint, faults) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "5")
        plan = make_plan(spec)
        reader = RowReader(plan.files, ["id", "prompt"])
        got = [reader.read(*plan.unit_rows(u)) for u in plan.units]
    assert [(u.rows, u.start) for u in plan.units] == [(u.rows, u.start) for u in want.units]
    assert [i for g in got for i in g["id"]] == [r["id"] for r in rows]
    kinds = {f for _, f, _ in proxy.injected}
    assert kinds == {"503", "500", "reset"}, proxy.injected  # every kind of fault was met
    assert any(req.startswith("GET /" + s3.name + "/t/a.parquet") for *_, req in proxy.injected), \
        "no Parquet read met a fault: the pyarrow path was not tested"


def test_throttling_past_the_attempts_fails_naming_the_uri(s3, tiny_model, monkeypatch):
    from tests.s3.faulty_proxy import FaultyProxy
    s3.put_rows("t/a.parquet", demo_rows(3))
    with FaultyProxy(s3.endpoint, {n: "503" for n in range(1, 100)}) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
        with pytest.raises(StorageError, match=rf"s3://{s3.name}/t: 503: .*AWS_MAX_ATTEMPTS"):
            find_input_files(spec_for(s3.uri("t"), tiny_model).input)
    assert len(proxy.injected) == 2  # AWS_MAX_ATTEMPTS tries of the first request (a HEAD), no more
