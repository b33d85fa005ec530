"""`batchrun verify OUT`: read every committed part file and check it against its commit marker.

Deeper than the check every resume makes (size, footer, sha256 only when the mtime moved): here
every part's sha256 is recomputed, the file is parsed, its row count compared with the marker and
the plan, and ids checked unique across the dataset. Part files that no marker claims are listed.
"""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc

from batchrun.job.exit_codes import ExitCode
from batchrun.job.report import load_state


def verify(out_path: str) -> tuple[str, bool]:
    """(report text, ok): ok only when every unit of the job is committed and whole."""
    text, code = verify_output(out_path)
    return text, code == ExitCode.OK


def verify_output(out_path: str) -> tuple[str, ExitCode]:
    """(report text, exit code): DAMAGED when a committed unit is missing or damaged (or ids
    repeat), else PENDING while some unit is not committed yet (what is committed checked out, but
    the output is not the whole job: a script must not publish it), else OK."""
    out, manifest, units = load_state(out_path)
    backend = out.backend
    commits = backend.read_commits()
    plan_rows = {u[0]: u[4] for u in units}
    problems = [f"unit {u}: {why}" for u, why in sorted(commits.damaged.items())]
    ids = []
    checked = rows = 0
    for unit, marker in sorted(commits.valid.items()):
        why = backend.check_part(unit, marker, manifest.get("fingerprint"), full=True)
        if why is None:
            try:
                pf = backend.open_part(unit)
                if "sample_index" in pf.schema_arrow.names:  # sampling.n > 1: count sample 0
                    table = pf.read(columns=["id", "sample_index"])
                    table = table.filter(pc.equal(table.column("sample_index"), 0)).select(["id"])
                else:
                    table = pf.read(columns=["id"])
            except (OSError, pa.ArrowException) as e:
                why = f"{os.path.basename(out.part(unit))} cannot be parsed ({e})"
            else:
                expected = plan_rows.get(unit)
                if table.num_rows != marker["rows"] or table.num_rows != expected:
                    why = (f"{os.path.basename(out.part(unit))} has {table.num_rows} rows; its marker says "
                           f"{marker['rows']}, the plan {expected}")
                else:
                    ids.append(table.column("id"))
                    checked += 1
                    rows += table.num_rows
        if why is not None:
            problems.append(f"unit {unit}: {why}")
    if ids:
        all_ids = pa.chunked_array([c for col in ids for c in col.chunks], ids[0].type)
        if pc.count_distinct(all_ids).as_py() != len(all_ids):
            problems.append("the dataset holds some id more than once")
    orphans = [os.path.basename(out.part(u)) for u in backend.uncommitted_parts(len(units), commits)]
    lines = [f"output:   {out.path}",
             f"verified: {checked}/{len(units)} units ({rows} rows): sha256, Parquet, row counts, unique ids"]
    if orphans:
        lines.append(f"note:     {len(orphans)} part file(s) not committed yet ({', '.join(orphans[:3])}"
                     f"{' ...' if len(orphans) > 3 else ''}); the next run rewrites them")
    if problems:
        lines.append(f"damaged:  {len(problems)} unit(s); rerun the job (same command) to rewrite them:")
        lines += [f"  {p}" for p in problems[:20]] + ([f"  ... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    missing = len(units) - len(commits.valid) - len(commits.damaged)
    if missing > 0:
        lines.append(f"pending:  {missing} of {len(units)} unit(s) not committed yet; the output is incomplete "
                     "(a run is still going, or rerun the job to finish it)")
    if problems:
        lines.append("DAMAGED")
        return "\n".join(lines), ExitCode.DAMAGED
    if missing > 0:
        lines.append("INCOMPLETE")
        return "\n".join(lines), ExitCode.PENDING
    lines.append("ok")
    return "\n".join(lines), ExitCode.OK
