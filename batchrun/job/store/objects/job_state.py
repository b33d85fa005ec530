"""The output's job state on an object store: prepare.py's _job_state with keys for files.

Under the planning lock (a lease: objects/lock.py) a run finishes an interrupted --restart,
then resumes the job the manifest names, refuses a different one, or restarts. A new plan is
uploaded under ``_batchrun/plan/`` before the manifest, and the manifest is created with
``If-None-Match: *``: one plan per output even if the lock's lease were lost while planning
(then the loser reads the winner's manifest and plan). Plans are read back through a local
temporary copy (the runner memory-maps the row arrays).
"""
from __future__ import annotations

import json
import os
import tempfile
import time

from batchrun import __version__
from batchrun.errors import ConfigError, JobChanged
from batchrun.job.plan.units import Plan, make_plan
from batchrun.job.store.layout import OutputDir
from batchrun.job.store.objects import restart
from batchrun.job.store.lock import acquire_waiting
from batchrun.job.store.objects.lock import ObjectLock

PLAN_FILES = ("plan.json", "row_file.npy", "row_index.npy")
_plan_copies: list[tempfile.TemporaryDirectory] = []  # kept while the process runs (memory maps)


def read_manifest(out: OutputDir, store) -> dict | None:
    got = store.get(out.manifest)
    if got is None:
        return None
    try:
        manifest = json.loads(got.data)
    except ValueError as e:
        raise ConfigError(f"output.path: {out.manifest} is damaged ({e}); rerun with --restart to start over") from None
    if not isinstance(manifest, dict) or "fingerprint" not in manifest:
        raise ConfigError(f"output.path: {out.manifest} is damaged (not a batchrun manifest); rerun with "
                          "--restart to start over")
    return manifest


def save_plan(plan: Plan, out: OutputDir, store) -> None:
    with tempfile.TemporaryDirectory(prefix="batchrun-plan-") as tmp:
        local = os.path.join(tmp, "plan")
        plan.save(local)
        for name in PLAN_FILES:
            with open(os.path.join(local, name), "rb") as f:
                store.put(f"{out.plan_dir}/{name}", f.read())


def load_plan(out: OutputDir, store) -> Plan | None:
    """The stored plan, or None if it is not all there."""
    copy = tempfile.TemporaryDirectory(prefix="batchrun-plan-")
    for name in PLAN_FILES:
        got = store.get(f"{out.plan_dir}/{name}")
        if got is None:
            copy.cleanup()
            return None
        with open(os.path.join(copy.name, name), "wb") as f:
            f.write(got.data)
    try:
        plan = Plan.load(copy.name)
    except (OSError, ValueError):
        copy.cleanup()
        return None
    _plan_copies.append(copy)
    return plan


def foreign_keys(out: OutputDir, store) -> list[str]:
    prefix = out.path.rstrip("/") + "/"
    return sorted({o.path[len(prefix):].split("/")[0] for o in store.list(prefix)} - {"_batchrun"})


def check_unowned(out: OutputDir, store) -> None:
    names = foreign_keys(out, store)
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ConfigError(f"output.path: {out.path} is not empty and does not hold a batchrun job (it has "
                          f"{shown}, and no _batchrun/manifest.json); batchrun only writes under a new or "
                          "empty prefix, or one of its own. Choose an empty or new prefix")


def check_writable(out: OutputDir, store) -> None:
    probe = f"{out.meta}/.probe.{os.getpid()}.{time.time_ns()}"
    store.put(probe, b"ok")
    store.delete(probe)


def job_state(spec, out: OutputDir, store, restart_flag, parts, fp, token, files, root, schema, file_ids, log,
              resolved, max_model_len: int, lease_s: float) -> Plan:
    from batchrun.job.plan.prepare import max_model_len_hint
    from batchrun.job.plan.resolve_engine import changed_message, resolution_changes
    from batchrun.job.store.fingerprint import PART_NAMES
    if store.stat(out.manifest) is None and not restart.pending_wipe(out, store):
        check_unowned(out, store)
    check_writable(out, store)
    lock = ObjectLock(store, f"{out.locks}/manifest.lock", "planning", lease_s, log)
    acquire_waiting(lock, 600.0, lambda e: log(f"another worker is planning {out.path}; waiting for its plan"),
                    poll=0.5)
    try:
        wiped = restart.pending_wipe(out, store)
        if wiped:
            log(f"finishing an interrupted --restart of {out.path} first")
            restart.finish_wipe(out, store)
        try:
            manifest = read_manifest(out, store)
        except ConfigError:
            if not restart_flag:
                raise
            manifest = None
        if manifest is not None and manifest.get("fingerprint") != fp and not restart_flag:
            changed = [PART_NAMES[k] for k, v in parts.items() if manifest.get("parts", {}).get(k) != v]
            raise JobChanged(
                f"output.path: {out.path} holds results of a different job (changed: "
                f"{'; '.join(changed) or 'batchrun version'}). " + max_model_len_hint(manifest, spec, max_model_len)
                + "Rerun with --restart to discard them, or choose another output.path.")
        if restart_flag and not (manifest is not None and token and manifest.get("restart_token") == token):
            restart.begin_wipe(out, store, manifest, lease_s)
            manifest, wiped = None, True
        if manifest is not None:
            started = manifest.get("engine_resolved") if isinstance(manifest.get("engine_resolved"), dict) else {}
            changes = resolution_changes(started, resolved)
            if changes:
                raise JobChanged(changed_message(out.path, changes))
        plan = None
        if manifest is None:
            if not wiped:
                check_unowned(out, store)
            store.delete_many([o.path for o in store.list(out.commits + "/")])  # markers without a manifest
        else:
            plan = load_plan(out, store)
        if plan is None:
            plan = make_plan(spec, files, root, schema)
            plan.fingerprint, plan.file_ids = fp, file_ids
            save_plan(plan, out, store)
            body = json.dumps({
                "fingerprint": fp, "parts": parts, "restart_token": token,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "batchrun_version": __version__,
                "engine_resolved": resolved, "job_file": spec.job_file, "job": spec.to_dict(),
                "total_rows": plan.total_rows, "total_units": len(plan.units),
                "part_files": "part-NNNNNN.parquet for units 0 .. total_units-1 (only these are ever deleted)",
            }, indent=1, sort_keys=True).encode()
            if manifest is None:
                if store.put(out.manifest, body, if_none_match=True) is None:
                    # another planner's manifest landed first (our lease was lost): use its plan
                    manifest = read_manifest(out, store)
                    if manifest is None or manifest.get("fingerprint") != fp:
                        raise JobChanged(f"output.path: another run created {out.manifest} for a different job "
                                         "while this one planned; rerun to see which")
                    plan = load_plan(out, store)
                    if plan is None:
                        raise ConfigError(f"output.path: {out.plan_dir} is incomplete; rerun with --restart")
            else:
                store.put(out.manifest, body)  # manifest whose plan was lost: the same job, planned again
        if wiped:
            restart.end_wipe(out, store)
        return plan
    finally:
        lock.release()
