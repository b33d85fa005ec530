"""kill -9 at points of the output protocol on GCS, then a rerun: every id exactly once; two
workers on one prefix; a restart killed midway. The crash points are tests/helpers/fake_cli.py's
(the store's calls are counted as "store.put:N" etc. whichever store the run uses); tests/s3
covers every point, these the ones whose GCS requests differ (conditional creates, compare-and-
swap renewals, conditional deletes, one delete per object)."""
from __future__ import annotations

import pytest

from tests.helpers.object_store import check_kill_then_rerun, check_restart_killed, check_two_workers, check_workers_pool


@pytest.mark.slow
@pytest.mark.parametrize("point", [
    "before_put:2", "after_put:3", "after_commit:1", "store.put:2", "store.put:6", "store.delete:2", "store.get:3",
])
def test_kill9_at_a_point_then_rerun_gives_every_id_once(gcs, tiny_model, tmp_path, point):
    check_kill_then_rerun(gcs, tiny_model, tmp_path, point)


@pytest.mark.slow
def test_kill9_during_restart_then_rerun(gcs, tiny_model, tmp_path):
    check_restart_killed(gcs, tiny_model, tmp_path, "store.delete_many:2", mark_written=True)


@pytest.mark.slow
def test_two_workers_on_one_prefix(gcs, tiny_model, tmp_path):
    check_two_workers(gcs, tiny_model, tmp_path, rows=60)


@pytest.mark.slow
def test_cpu_workers_pool_on_a_gs_prefix(gcs, tiny_model, tmp_path):
    check_workers_pool(gcs, tiny_model, tmp_path)
