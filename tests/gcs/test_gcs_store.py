"""The generation preconditions the output protocol stands on, the leases built from them, and how
failures are retried or reported, against the test server (tests/gcs/conftest.py). The first test
is the probe: if the server (or preconditions.py, which adds what the emulator lacks) stopped
honouring a condition, it fails here by name instead of letting the protocol tests pass on a
server that cannot race."""
from __future__ import annotations

import time

import pytest

from batchrun.job.storage.errors import StorageError
from batchrun.job.storage.registry import storage_for
from tests.helpers.object_store import (check_live_lease_refused_stale_one_taken_over_once,
                                        check_renewal_defeats_a_stale_take_over)
from tests.s3.faulty_proxy import FaultyProxy


def test_the_server_honours_every_condition_the_protocol_uses(gcs, monkeypatch):
    store = storage_for(gcs.uri("k"))
    gen = store.put(gcs.uri("k"), b"one", if_none_match=True)
    assert gen is not None and store.stat(gcs.uri("k")).version == gen
    assert store.put(gcs.uri("k"), b"two", if_none_match=True) is None  # ifGenerationMatch=0 on upload
    assert store.put(gcs.uri("k"), b"two", if_match="1") is None  # ifGenerationMatch=<gen> on upload
    gen2 = store.put(gcs.uri("k"), b"two", if_match=gen)
    assert gen2 is not None and gen2 != gen
    assert store.delete(gcs.uri("k"), if_match=gen) is False  # ifGenerationMatch on delete
    got = store.get(gcs.uri("k"))
    assert got.data == b"two" and got.etag == gen2
    assert store.delete(gcs.uri("k"), if_match=gen2) is True and store.get(gcs.uri("k")) is None
    # a body above the client's multipart limit goes as a resumable upload: still conditional
    import google.cloud.storage.blob as blob_module
    monkeypatch.setattr(blob_module, "_MAX_MULTIPART_SIZE", 16)
    big = b"x" * 1000
    assert store.put(gcs.uri("big"), big, if_none_match=True) is not None
    assert store.put(gcs.uri("big"), b"y" * 1000, if_none_match=True) is None
    assert store.put(gcs.uri("big"), b"y" * 1000, if_match="1") is None
    assert store.get(gcs.uri("big")).data == big


def test_get_reads_the_stores_clock_and_the_objects_time(gcs):
    store = storage_for(gcs.uri("t"))
    store.put(gcs.uri("t"), b"x")
    before = time.time()
    got = store.get(gcs.uri("t"))
    # the Date header has 1 s steps; the emulator runs on this host's clock
    assert before - 1.5 <= got.now <= time.time() + 0.5
    assert abs(got.last_modified - before) < 5


def test_a_live_lease_is_refused_a_stale_one_taken_over_once(gcs):
    check_live_lease_refused_stale_one_taken_over_once(gcs)


def test_a_renewal_between_read_and_take_over_defeats_the_take_over(gcs):
    check_renewal_defeats_a_stale_take_over(gcs)


def test_a_conditional_create_whose_answer_was_lost_is_ours(gcs, monkeypatch):
    """The first attempt is applied but its answer never arrives; the retry gets 412 (the object
    is there now). The object holds our bytes, so the write is ours, not someone else's lease."""
    with FaultyProxy(gcs.endpoint, {1: "lost"}) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        store = storage_for(gcs.uri("claim"))
        gen = store.put(gcs.uri("claim"), b"mine", if_none_match=True)
        assert [f for _, f, _ in proxy.injected] == ["lost"]
    assert gen is not None and gen == str(gcs.client.bucket(gcs.name).get_blob("claim").generation)
    # another writer's bytes are not ours: the same loss on a taken key still says "taken"
    with FaultyProxy(gcs.endpoint, {1: "lost"}) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        assert storage_for(gcs.uri("claim")).put(gcs.uri("claim"), b"other", if_none_match=True) is None


def test_transient_503_and_resets_are_retried(gcs, monkeypatch):
    with FaultyProxy(gcs.endpoint, {1: "503", 2: "reset", 4: "503"}) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        store = storage_for(gcs.uri("r"))
        assert store.put(gcs.uri("r"), b"body", if_none_match=True) is not None  # requests 1, 2, 3
        assert store.get(gcs.uri("r")).data == b"body"  # 4 (503), 5, 6
        assert [f for _, f, _ in proxy.injected] == ["503", "reset", "503"]
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # past the attempts: exit 7 naming the URI
    with FaultyProxy(gcs.endpoint, {1: "503", 2: "503"}) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        with pytest.raises(StorageError, match=rf"output.path: {gcs.uri('r')}: 503: .*AWS_MAX_ATTEMPTS"):
            storage_for(gcs.uri("r"), field="output.path").put(gcs.uri("r"), b"again")
        assert proxy.count == 2


def test_a_403_is_not_retried_and_names_the_uri_and_fix(gcs, monkeypatch):
    with FaultyProxy(gcs.endpoint, {1: "403"}) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        with pytest.raises(StorageError, match=rf"output.path: {gcs.uri('f')}: Forbidden: .*roles/storage"):
            storage_for(gcs.uri("f"), field="output.path").put(gcs.uri("f"), b"x")
        assert proxy.count == 1


def test_a_401_names_the_credentials_fix(gcs, monkeypatch):
    with FaultyProxy(gcs.endpoint, {1: "401"}) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        with pytest.raises(StorageError, match=rf"input.path: {gcs.uri('u')}: Unauthorized: .*application-default login"):
            storage_for(gcs.uri("u")).stat(gcs.uri("u"))
        assert proxy.count == 1


def test_missing_bucket_and_unreachable_endpoint_exit_7(gcs, monkeypatch):
    with pytest.raises(StorageError, match=r"input.path: gs://batchrun-no-such-bucket/k: NoSuchBucket"):
        storage_for("gs://batchrun-no-such-bucket/k").stat("gs://batchrun-no-such-bucket/k")
    with pytest.raises(StorageError, match=r"output.path: gs://batchrun-no-such-bucket/k: NoSuchBucket"):
        storage_for("gs://batchrun-no-such-bucket/k", field="output.path").put("gs://batchrun-no-such-bucket/k", b"x")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    with pytest.raises(StorageError, match=rf"input.path: {gcs.uri('k')}: Unreachable: .*STORAGE_EMULATOR_HOST"):
        storage_for(gcs.uri("k")).stat(gcs.uri("k"))


def test_no_credentials_names_the_gcloud_fix(monkeypatch, tmp_path):
    pytest.importorskip("google.cloud.storage")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(StorageError, match=r"gs://b/k: NoCredentials: .*gcloud auth application-default login"):
        storage_for("gs://b/k").stat("gs://b/k")


def test_endpoint_url_wins_over_the_environment_and_profile_is_refused(gcs, monkeypatch):
    from batchrun.errors import ConfigError
    from batchrun.job.storage.options import StorageOptions
    gcs.write("e", b"here")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # only says "emulator: no credentials"
    store = storage_for(gcs.uri("e"), StorageOptions(endpoint_url=gcs.endpoint))
    assert store.get(gcs.uri("e")).data == b"here"
    with pytest.raises(ConfigError, match=r"output.storage_options.profile: profiles are S3's"):
        storage_for(gcs.uri("e"), StorageOptions(profile="p"), "output.path")
