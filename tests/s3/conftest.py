"""A real S3-compatible server on localhost for the whole session (moto's standalone server,
installed by the `test` extra), and per test a fresh bucket with the AWS variables pointing at it.

The server runs in this process's thread (ThreadedMotoServer) on a free port and is stopped at the
end of the session. Subprocesses (the CLI) reach it over HTTP like any S3 endpoint: only the
environment tells them where it is, as it would tell the AWS CLI.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest


ACCESS_KEY, SECRET_KEY, REGION = "testing-key", "testing-secret", "us-east-1"
_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_server():
    pytest.importorskip("boto3", reason="the s3 tests need the test extra (boto3, moto[server])")
    pytest.importorskip("moto.server", reason="the s3 tests need the test extra (moto[server])")
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@dataclass
class Bucket:
    endpoint: str
    name: str
    client: object  # a boto3 S3 client of the test's own

    def uri(self, key: str = "") -> str:
        return f"s3://{self.name}/{key}"

    def put_rows(self, key: str, rows: list[dict], schema=None, row_group_size: int | None = None) -> str:
        import io
        import pyarrow as pa
        import pyarrow.parquet as pq
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf, row_group_size=row_group_size)
        self.client.put_object(Bucket=self.name, Key=key, Body=buf.getvalue())
        return self.uri(key)

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.name, Key=key)["Body"].read()

    def list_keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return sorted(o["Key"] for p in pages for o in p.get("Contents", ()))

    def put_file(self, key: str, path) -> str:
        self.client.upload_file(str(path), self.name, key)
        return self.uri(key)


def s3_env(endpoint: str) -> dict:
    """The environment an AWS tool would be given for the test server."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "3"}


@pytest.fixture
def s3(s3_server, monkeypatch) -> Bucket:
    """A new, empty bucket; this process's AWS variables point at the test server."""
    import boto3
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    for k, v in s3_env(s3_server).items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=s3_server, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name=REGION)
    name = f"batchrun-test-{os.getpid()}-{next(_buckets)}"
    client.create_bucket(Bucket=name)
    return Bucket(s3_server, name, client)


@pytest.fixture
def s3_auth(s3, monkeypatch) -> tuple[str, str]:
    """The test server checks credentials from here on (moto checks none by default): an IAM user
    allowed s3:* gets a key, this process's AWS variables use it, and the (access key, secret) is
    returned. Only one test runs at a time in a process, so switching the in-process server's
    setting for one test is safe; monkeypatch switches it back."""
    import json
    import boto3
    import moto.settings
    iam = boto3.client("iam", endpoint_url=s3.endpoint, aws_access_key_id=ACCESS_KEY,
                       aws_secret_access_key=SECRET_KEY, region_name=REGION)
    user = f"batchrun-{s3.name}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    s3.client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=key["AccessKeyId"],
                             aws_secret_access_key=key["SecretAccessKey"], region_name=REGION)
    return key["AccessKeyId"], key["SecretAccessKey"]
