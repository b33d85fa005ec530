"""The conditional requests the S3 protocol stands on, and the leases built from them, against
the test server. The first test is the probe: if a server version stopped honouring a condition,
it fails here by name instead of letting the protocol tests pass on a server that cannot race."""
from __future__ import annotations


import pytest

from batchrun.job.storage.registry import storage_for
from tests.helpers.object_store import (check_live_lease_refused_stale_one_taken_over_once,
                                        check_renewal_defeats_a_stale_take_over)


def test_the_server_honours_every_condition_the_protocol_uses(s3):
    store = storage_for(s3.uri("k"))
    etag = store.put(s3.uri("k"), b"one", if_none_match=True)
    assert etag is not None
    assert store.put(s3.uri("k"), b"two", if_none_match=True) is None  # If-None-Match: * on PUT
    assert store.put(s3.uri("k"), b"two", if_match='"0000"') is None  # If-Match on PUT
    etag2 = store.put(s3.uri("k"), b"two", if_match=etag)
    assert etag2 is not None and etag2 != etag
    assert store.delete(s3.uri("k"), if_match=etag) is False  # If-Match on DELETE
    assert store.get(s3.uri("k")).data == b"two"
    assert store.delete(s3.uri("k"), if_match=etag2) is True and store.get(s3.uri("k")) is None
    # a multipart upload's completion honours If-None-Match too (parts above 64 MiB go that way)
    from batchrun.job.storage import s3 as s3mod
    big = b"x" * (s3mod.MULTIPART_PART + 10)
    old = s3mod.MULTIPART_THRESHOLD
    s3mod.MULTIPART_THRESHOLD = 1
    try:
        assert store.put(s3.uri("mp"), big, if_none_match=True) is not None
        assert store.put(s3.uri("mp"), big, if_none_match=True) is None
    finally:
        s3mod.MULTIPART_THRESHOLD = old
    assert store.get(s3.uri("mp")).data == big


def test_a_live_lease_is_refused_a_stale_one_taken_over_once(s3):
    check_live_lease_refused_stale_one_taken_over_once(s3)


def test_a_renewal_between_read_and_take_over_defeats_the_take_over(s3):
    check_renewal_defeats_a_stale_take_over(s3)


def test_output_in_a_missing_bucket_exits_7_naming_the_uri(s3, tiny_model, tmp_path):
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.run.runner import run_job
    from batchrun.job.storage.errors import StorageError
    from tests.helpers.fake_engine import FakeEngine
    from tests.helpers.jobs import demo_rows
    from tests.s3.helpers import job_file
    s3.put_rows("in/a.parquet", demo_rows(4))
    job = job_file(tmp_path, tiny_model, s3.uri("in"), "s3://batchrun-no-such-bucket/out")
    with pytest.raises(StorageError, match=r"output.path: s3://batchrun-no-such-bucket/out/\S*: NoSuchBucket"):
        run_job(load_job(job), engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None)


def test_a_conditional_create_whose_answer_was_lost_is_ours(s3, monkeypatch):
    """The first PUT is applied but its answer never arrives; botocore retries it and gets 412 (the
    object is there now). The object holds our bytes, so the write is ours (as on GCS)."""
    from tests.s3.faulty_proxy import FaultyProxy
    with FaultyProxy(s3.endpoint, {1: "lost"}) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        etag = storage_for(s3.uri("claim")).put(s3.uri("claim"), b"mine", if_none_match=True)
        assert [f for _, f, _ in proxy.injected] == ["lost"]
    assert etag is not None and etag == s3.client.head_object(Bucket=s3.name, Key="claim")["ETag"]
    with FaultyProxy(s3.endpoint, {1: "lost"}) as proxy:  # another writer's bytes are not ours
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert storage_for(s3.uri("claim")).put(s3.uri("claim"), b"other", if_none_match=True) is None
