"""batchrun command line: run, plan, status, show, verify, slurm, bench.

Size (~320 lines): one click command per user-facing verb with its options and help text, the
README's command table in code; each command only parses its flags and calls the module that does
the work, so splitting it would scatter the CLI's help without making any piece simpler.

Exit codes (README "Exit codes"): see exit_codes.ExitCode. Each failure prints one line starting with
"batchrun: error:" that names the file/field and the fix; only internal errors print a traceback.
"""
from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import replace

import click

from batchrun.errors import ConfigError, OutputIOError, io_message
from batchrun.job.run.error_rate import ErrorRateExceeded, check_job
from batchrun.job.exit_codes import HELP as EXIT_CODES_HELP, ExitCode, exit_code_of
from batchrun.job.run.interrupt import Interrupted


def _fail(code: ExitCode, message: str):
    click.echo(f"batchrun: error: {message}", err=True)
    sys.exit(int(code))


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


def slurm_task_defaults() -> tuple[int | None, int | None]:
    """(task_id, num_tasks) from a Slurm array's environment, or (None, None) outside one.

    Array ids may start at an offset (--array=1-8) or step (--array=0-15:4), so the task id is
    (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP; the count is
    SLURM_ARRAY_TASK_COUNT, else (SLURM_ARRAY_TASK_MAX - SLURM_ARRAY_TASK_MIN) / STEP + 1.
    """
    tid = _env_int("SLURM_ARRAY_TASK_ID")
    if tid is None:
        return None, None
    tmin = _env_int("SLURM_ARRAY_TASK_MIN") or 0
    step = _env_int("SLURM_ARRAY_TASK_STEP") or 1
    count, tmax = _env_int("SLURM_ARRAY_TASK_COUNT"), _env_int("SLURM_ARRAY_TASK_MAX")
    if count is None and tmax is not None:  # Slurm without SLURM_ARRAY_TASK_COUNT
        count = (tmax - tmin) // step + 1
    return (tid - tmin) // step, count


def kubernetes_task_id() -> int | None:
    """This pod's index in a Kubernetes Indexed Job (JOB_COMPLETION_INDEX, 0-based), or None.
    Kubernetes exposes no completion count to the pod: the manifest passes --num-tasks."""
    return _env_int("JOB_COMPLETION_INDEX")


def worker_name(task_id: int) -> str:
    """Lock/temp/metrics name of this worker: the task id, plus the array job id inside a Slurm
    array (two arrays joining one output directory both have a task 0; a requeue keeps its name)."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID", "").strip()
    return f"{task_id}-j{job}" if job.isdigit() else str(task_id)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES_HELP)
@click.version_option(package_name="batchrun")
@click.pass_context
def main(ctx):
    """Offline batch inference: Parquet prompts + a local HF model + LoRA adapters -> Parquet outputs.

    Rows that cannot run are written as error rows and the job goes on (on_error: skip). The run
    that completes a job exits 10 when error rows are more than max_error_rate of its output rows
    (job file or `run --max-error-rate`, counted over the whole output); unset, only when every
    row failed. `verify` and `status` exit 0 only for a complete output (9 while units are
    pending, 8 for damaged parts)."""
    if ctx.invoked_subcommand != "run":  # `run` ends its start-up itself, before its first write
        from batchrun.job.run.interrupt import start_up_over
        start_up_over()


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--task-id", type=click.IntRange(min=0), default=None,
              help="This task's index, 0-based. Default: from SLURM_ARRAY_TASK_ID (minus SLURM_ARRAY_TASK_MIN), "
                   "else a Kubernetes Indexed Job's JOB_COMPLETION_INDEX, else 0.")
@click.option("--num-tasks", type=click.IntRange(min=1), default=None,
              help="How many workers are expected: a hint for where this one starts claiming units (any "
                   "number of workers may join one output dir). Default: SLURM_ARRAY_TASK_COUNT, else 1 "
                   "(in a Kubernetes Indexed Job give the Job's completions).")
@click.option("--restart", is_flag=True,
              help="Discard a previous run's outputs in output.path and start over (needed when the job changed).")
@click.option("--restart-token", default=None, metavar="TOKEN",
              help="Restart once per TOKEN: like --restart, unless the output dir was already restarted "
                   "with this token (then resume). `batchrun slurm --restart` scripts use it, so a "
                   "resubmitted or requeued script resumes instead of wiping again.")
@click.option("--progress", type=click.Choice(["auto", "bar", "log", "none"]), default="auto", show_default=True,
              help="bar: a tqdm bar; log: one line per --log-interval (for Slurm/cron logs); auto: bar on a "
                   "terminal, log otherwise.")
@click.option("--log-interval", type=click.FloatRange(min=0.0), default=30.0, show_default=True,
              help="Seconds between progress lines in log mode.")
@click.option("--verbose", is_flag=True, help="In log mode, also one line per committed unit.")
@click.option("--no-progress", is_flag=True, help="Same as --progress none (the summary is still printed).")
@click.option("--claim-lease", type=click.FloatRange(min=0.0, min_open=True), default=None, metavar="S",
              help="Seconds a unit claim lives without renewal before another worker may take the unit over "
                   "(default: $BATCHRUN_CLAIM_LEASE, else 120).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Run N worker processes on this node over the same unit claims (CPU workers unless --gpus).")
@click.option("--gpus", default=None, metavar="0,1,...|all",
              help="One worker per listed GPU (CUDA_VISIBLE_DEVICES=that id); 'all' = every visible GPU.")
@click.option("--max-error-rate", type=click.FloatRange(0.0, 1.0), default=None, metavar="R",
              help="Exit 10 when the finished job's error rows are more than this fraction of its output "
                   "rows, counted over the whole output (resumed runs and other workers included); the "
                   "output is kept. Overrides the job file's max_error_rate. Default: exit 10 only when "
                   "every row is an error row; 1 never fails.")
def run(job, task_id, num_tasks, restart, restart_token, progress, log_interval, verbose, no_progress,
        claim_lease, workers, gpus, max_error_rate):
    """Run JOB (a job.yaml), or this task's share of it; resumes a previous run.

    \b
    Error rows: a row that cannot run (bad prompt, bad per-row override, unknown adapter) is written
    as an error row (on_error: skip, the default) and the run goes on. When the whole job is done,
    it exits 10 if error rows are more than max_error_rate of the output rows (job file or
    --max-error-rate; unset: only if every row failed)."""
    from batchrun.common import preload
    if workers is None and gpus is None:  # a worker pool's parent runs no engine
        preload.start()  # torch & co. import while the job is checked and planned (preload.py)
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.run.runner import run_job

    if (workers is not None or gpus is not None) and (task_id is not None or num_tasks is not None):
        _fail(ExitCode.USAGE, "--workers/--gpus start their own tasks 0..N-1: drop --task-id/--num-tasks")
    env_tid, env_n = slurm_task_defaults()
    if env_tid is None and task_id is None and kubernetes_task_id() is not None:
        env_tid = kubernetes_task_id()
        if num_tasks is None:
            _fail(ExitCode.USAGE, f"JOB_COMPLETION_INDEX={env_tid} (a Kubernetes Indexed Job) gives this "
                  "task's index but not the task count: pass --num-tasks with the Job's "
                  "spec.completions (docs/scaling.md has a manifest)")
    task_id = task_id if task_id is not None else (env_tid or 0)
    num_tasks = num_tasks if num_tasks is not None else (env_n or 1)
    if num_tasks < 1 or not 0 <= task_id < num_tasks:
        _fail(ExitCode.USAGE, f"--task-id must be in [0, --num-tasks={num_tasks}), got {task_id} "
              "(with a Slurm array of non-contiguous ids, pass --task-id/--num-tasks explicitly)")
    held = []
    try:
        from batchrun.job.store.claims import lease_from_env
        claim_lease = lease_from_env(claim_lease)
    except ValueError as e:
        _fail(ExitCode.USAGE, str(e))
    if workers is not None or gpus is not None:
        from batchrun.job.run.interrupt import start_up_over
        start_up_over()  # the parent forwards signals to its workers (workers.py)
        _run_workers(job, workers, gpus, restart, restart_token, log_interval, claim_lease, max_error_rate)
    try:
        from batchrun.job.launch.workers import GPU_ENV, check_worker_device
        if os.environ.get(GPU_ENV):
            check_worker_device()
    except ConfigError as e:
        _fail(ExitCode.CONFIG, str(e))
    try:
        spec = load_job(job)
        if max_error_rate is not None:
            spec = replace(spec, max_error_rate=max_error_rate)
        _preload_tokenizer(spec)
        stats = run_job(spec, task_id, num_tasks, restart=restart, progress="none" if no_progress else progress,
                        log=lambda m: click.echo(m, err=True), log_interval=log_interval, verbose=verbose,
                        on_stats=held.append, restart_token=restart_token, worker=worker_name(task_id),
                        claim_lease=claim_lease)
    except BaseException as e:
        if isinstance(e, SystemExit):
            raise
        code = exit_code_of(e)
        if code == ExitCode.INTERNAL:
            traceback.print_exc()
        signal_name = str(e) if isinstance(e, Interrupted) else "SIGINT"  # else: KeyboardInterrupt
        if held:
            _summary_block(held[0], code, f"interrupted by {signal_name}" if code == ExitCode.INTERRUPTED
                           else f"{held[0].status}: {type(e).__name__}")
        if code == ExitCode.INTERRUPTED:
            _fail(code, f"interrupted ({signal_name}); no partial file was left. "
                  "Rerun the same command to resume after the committed units.")
        if code == ExitCode.INTERNAL:
            _fail(code, "internal error (traceback above); committed units are kept, a rerun resumes")
        if isinstance(e, OSError) and not isinstance(e, OutputIOError):
            _fail(code, io_message(e, "cannot access a file"))
        _fail(code, str(e))
    job_totals = _summary(spec, stats)
    try:
        check_job(job_totals, spec.max_error_rate)
    except ErrorRateExceeded as e:
        _summary_block(stats, ExitCode.ERROR_RATE, "done, but too many error rows")
        _fail(ExitCode.ERROR_RATE, str(e))
    _summary_block(stats, ExitCode.OK, "done")


def _preload_tokenizer(spec) -> None:
    """The engine's tokenizer loads on the preload thread after the imports; prepare's tokenizer
    check then finds it loaded (or raises its error)."""
    from batchrun.common import preload
    from batchrun.common.tokenizer import load_tokenizer
    if not spec.input.prompt_token_ids_column:
        preload.then(lambda: load_tokenizer(spec.model))


def _run_workers(job, workers, gpus, restart, restart_token, log_interval, claim_lease, max_error_rate):
    """--workers/--gpus: the parent of N `batchrun run` workers; exits with the worst of their codes."""
    import uuid
    from batchrun.job.launch import workers as wk
    from batchrun.job.jobfile.spec import load_job
    if any(os.environ.get(v) for v in ("BATCHRUN_WORKER_GPU",)):
        _fail(ExitCode.USAGE, "--workers/--gpus inside a worker: nested worker pools are not supported")
    try:
        spec = load_job(job)
        devices = wk.pick_gpus(gpus, workers, wk.visible_gpus() if gpus is not None else [])
    except ConfigError as e:
        _fail(ExitCode.CONFIG if not str(e).startswith("--") else ExitCode.USAGE, str(e))
    args = ["run", job, "--progress", "none", "--claim-lease", str(claim_lease)]
    if max_error_rate is not None:  # the worker that completes the job judges it (error_rate.py)
        args += ["--max-error-rate", repr(max_error_rate)]
    if restart or restart_token:  # restart once for the whole pool, not once per worker
        args += ["--restart-token", restart_token or uuid.uuid4().hex[:16]]
    code = wk.run_workers(wk.worker_command() + args, devices, spec.output.path,
                          log=lambda m: click.echo(m, err=True), interval=log_interval,
                          storage_options=spec.output.storage_options)
    sys.exit(code)


def _summary_block(st, code, what: str) -> None:
    from batchrun.job.run.progress_bar import summary_lines
    for line in summary_lines(st, int(code), what):
        click.echo(line, err=True)


def _summary(spec, st) -> dict:
    """Print the task's and the job's totals; return the job's (metrics.job_metrics)."""
    from batchrun.job.store.layout import OutputDir
    out = OutputDir(spec.output.path, spec.output.storage_options)
    m = out.backend.read_json(out.manifest)
    job = out.backend.job_metrics(m["total_units"], m["total_rows"], spec.sampling.n)
    rows = (f"{st.committed_rows} rows" if st.committed_rows == st.committed_output_rows  # sampling.n = 1
            else f"{st.committed_rows} input rows -> {st.committed_output_rows} output rows")
    click.echo(
        f"task {st.task_id}/{st.num_tasks}: {st.units_done} unit(s) written, {st.units_skipped} already done; "
        f"{rows} ({st.error_rows} error rows), {st.output_tokens} output tokens in {st.elapsed_s:.1f}s "
        f"(model load {st.model_load_s:.1f}s, {st.output_tok_per_s:.0f} output tok/s)", err=True)
    click.echo(f"job: {job['units_committed']}/{job['units_total']} units, {job['rows_committed']}/"
               f"{job['rows_total']} rows, {job['error_rows']} error rows -> {out.path}"
               + ("" if job["complete"] else "  (other tasks' units still pending)"), err=True)
    return job


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--num-tasks", type=click.IntRange(min=1), default=None,
              help="Show task shares for this many tasks (default: Slurm env or 1).")
@click.option("--no-tokens", is_flag=True, help="Skip tokenizing prompts (faster on huge inputs).")
@click.option("--estimate-tokens", is_flag=True,
              help="Plain-text prompts: estimate the prompt-token totals from a sample of rows (marked ~); "
                   "error rows stay exact. Seconds instead of minutes on millions of rows.")
def plan(job, num_tasks, no_tokens, estimate_tokens):
    """Validate JOB without loading weights and print its shards, work units and task shares."""
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.report import plan_report
    num_tasks = num_tasks or slurm_task_defaults()[1] or 1
    with _read_errors():
        click.echo(plan_report(load_job(job), num_tasks, count_tokens=not no_tokens,
                               estimate_tokens=estimate_tokens))


@main.command()
@click.argument("out", type=click.Path(file_okay=False))
def status(out):
    """Progress of the job whose output directory is OUT: units, rows, errors, running tasks.

    Exit 0 when every unit is committed, 9 while some are pending (running, or a rerun must finish
    them), 8 when a committed unit's part file is missing or damaged (a rerun rewrites it)."""
    from batchrun.job.report import status_report
    with _read_errors():
        text, code = status_report(out)
    click.echo(text)
    if code != ExitCode.OK:
        sys.exit(int(code))


@main.command()
@click.argument("out", type=click.Path(file_okay=False))
def verify(out):
    """Read every part file of OUT and check it against its commit (sha256, rows, unique ids).

    Exit 0 only when every unit of the job is committed and whole; 8 when some committed unit is
    missing or damaged (a rerun of the job rewrites it); 9 while units are pending (the output is
    incomplete: `verify OUT && publish` never publishes part of a job)."""
    from batchrun.job.store.verify import verify_output
    with _read_errors():
        text, code = verify_output(out)
    click.echo(text)
    if code != ExitCode.OK:
        sys.exit(int(code))


@main.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--limit", type=click.IntRange(min=0), default=10, show_default=True, help="Rows to print (spread over adapters).")
@click.option("--prompts/--no-prompts", default=True, show_default=True, help="Also print each row's prompt.")
def show(out, limit, prompts):
    """Print a few output rows of OUT."""
    from batchrun.job.report import show_rows
    with _read_errors():
        click.echo(show_rows(out, limit, prompts))


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--array", "array", type=click.IntRange(min=1), required=True, help="Number of array tasks (one GPU each).")
@click.option("--script", type=click.Path(dir_okay=False), default=None,
              help="Where to write the sbatch script. Default: next to JOB, as <job>.sbatch.")
@click.option("--time", "time_", default="24:00:00", show_default=True, help="#SBATCH --time")
@click.option("--cpus", default=8, show_default=True, help="#SBATCH --cpus-per-task")
@click.option("--mem", default="64G", show_default=True, help="#SBATCH --mem")
@click.option("--partition", default=None, help="#SBATCH --partition")
@click.option("--account", default=None, help="#SBATCH --account")
@click.option("--gpus-per-task", type=click.IntRange(min=0), default=None,
              help="GPUs of each array task (#SBATCH --gpus-per-task=N, --ntasks=1). Default: the job's "
                   "engine.device (cpu: none; auto or cuda: 1); 0 writes no GPU request (clusters without GPU gres).")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="ARG",
              help="Another #SBATCH line, e.g. --sbatch-arg=--qos=long (repeatable).")
@click.option("--restart", is_flag=True,
              help="The script restarts the output dir once: a token in the script makes its tasks, "
                   "requeues and resubmissions resume instead of wiping again.")
@click.option("--signal-before", type=int, default=120, show_default=True, metavar="S",
              help="Seconds before the time limit at which Slurm sends the task SIGTERM (#SBATCH "
                   "--signal=B:TERM@S): batchrun then stops cleanly (exit 130) and a resubmission resumes. "
                   "Allow for the units in flight to finish writing; Slurm may signal up to 60 s early.")
@click.option("--submit", is_flag=True, help="Run sbatch on the script.")
def slurm(job, array, script, time_, cpus, mem, partition, account, gpus_per_task, sbatch_args, restart,
          signal_before, submit):
    """Write an sbatch script running JOB as a Slurm array of ARRAY tasks; --submit submits it."""
    from batchrun.job.launch import slurm as sl
    try:
        spec = sl.read_job(job)  # variables in its paths are expanded by each task, not here
        path = script or os.path.splitext(spec.job_file)[0] + ".sbatch"
        text = sl.sbatch_script(spec, array, path, cpus=cpus, mem=mem, time=time_, partition=partition,
                                account=account, restart=restart, gpus_per_task=gpus_per_task,
                                sbatch_args=sbatch_args, signal_before=signal_before)
        sl.write_script(spec, path, text)
        click.echo(f"wrote {path}")
        if spec.object_output:
            click.echo(f"note: output.path is an object-store URI: task logs go to "
                       f"{sl.slurm_log_dir(spec, path)}/{sl.log_name(spec)}-<array job id>_<task id>.out")
        if spec.unset:
            click.echo(f"note: {', '.join('$' + v for v in spec.unset)} not set here: the job's paths are "
                       "expanded and checked by each task when it starts (`batchrun plan` where they are set "
                       "checks them now)")
        if submit:
            click.echo(sl.submit(path))
        else:
            click.echo(f"submit with: sbatch {path}")
    except ConfigError as e:
        _fail(ExitCode.CONFIG, str(e))
    except OSError as e:
        _fail(ExitCode.CONFIG, f"cannot write the sbatch script: {e}")


@contextmanager
def _read_errors():
    """plan/status/show/verify: a bad job, directory or file is one error line, not a traceback."""
    import pyarrow as pa
    try:
        yield
    except ConfigError as e:
        _fail(ExitCode.CONFIG, str(e))
    except OutputIOError as e:  # an object store refusing (no bucket, access denied): names the URI
        _fail(ExitCode.OUTPUT_IO, str(e))
    except OSError as e:
        _fail(ExitCode.OUTPUT_IO, f"cannot read {e.filename or 'a file'}: {e.strerror or e}; check that it "
              "exists and is readable")
    except pa.ArrowException as e:
        _fail(ExitCode.CONFIG, f"a Parquet file cannot be read: {e}; run `batchrun verify` on the output "
              "directory, or check the input files")


def _register_bench() -> None:
    """`batchrun bench ...` lives in batchrun/bench/cli.py (light to import: torch loads when a
    benchmark runs)."""
    from batchrun.bench.cli import bench
    main.add_command(bench, name="bench")


_register_bench()

if __name__ == "__main__":
    main()
