"""`batchrun bench throughput`: the engine alone vs the real job path, on the same rows.

Size (~330 lines): the run's parameters (one dataclass mirroring the CLI flags), the two
measured subprocesses and the output check belong to one procedure; the workload writer, the
engine-alone child, the summary and the printout are already their own modules.

1. Writes (workload.py) a random-weight model directory of the preset's shape, a word-level
   tokenizer, --num-adapters random PEFT adapters, Parquet inputs and a job.yaml.
2. (a) engine alone: `python -m batchrun.bench.engine_alone job.yaml` (the job's engine, all
   rows in one timed `generate` call after an untimed warm-up of --engine-warmup-rows rows, so
   it measures the engine at speed while the job's generation is a cold first call; its own
   process);
   (b) the job: `python -m batchrun run job.yaml` as a subprocess, timed from outside
   (spawn -> exit) and broken down with the run's own metrics file
   (_batchrun/metrics/task-0.json: started, startup_s, model_load_s, writing_s, elapsed_s);
   every stdout/stderr line is also stamped with its arrival time (kept in the JSON);
   (c) job / engine ratios.
3. Checks the output dataset: every input id exactly once, no error rows, output lengths, and
   a digest of every row's output tokens (both runs), so that two invocations (e.g. with and
   without --enable-prefix-caching) can be compared for identical outputs. Exact on CPU; on a
   GPU, rounding can depend on how rows were batched, and random weights leave near-ties, so
   the engine-alone and job digests (different batches) may differ without a bug.

--prefix-len P: every prompt starts with the same P tokens (then its own --input-len); the
engine alone's prefix-cache hit rate is printed (its warm-up's cache entries are dropped first,
so the timed call starts cold like the job).

tok/s = (prompt + output tokens) / seconds, with the token counts the runs report (they equal
(prefix_len + input_len + output_len) * num_prompts when every row ran to --output-len;
"tokens_as_asked" says whether they did).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from batchrun.bench import workload
from batchrun.bench.presets import PRESET_MODELS
from batchrun.bench.throughput_report import outputs_digest, summarize
from batchrun.bench.flags import engine_config
from batchrun.engine.envs import Experiments

RANDOM_NOTE = ("RANDOM WEIGHTS: {preset}-shaped model with weights ~ N(0, 0.02) and random "
               "adapters (nothing can be downloaded here); the timings are real, the generated "
               "tokens are noise")
STAMP = "bench-model.json"  # in a kept --workdir: which model the directory holds


@dataclass
class ThroughputParams:
    preset: str = "7b"
    input_len: int = 256
    prefix_len: int = 0  # tokens every prompt starts with (before its own input_len)
    output_len: int = 128
    num_prompts: int = 1024
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    lora_fraction: float = 0.5
    num_adapters: int = 4
    lora_rank: int = 16
    max_loras: int | None = None  # None = num_adapters (all adapters resident)
    rows_per_unit: int = 1024
    engine_warmup_rows: int = 32  # untimed warm-up generate before the engine-alone call
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.90
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    workdir: str | None = None  # None: a temporary directory, removed afterwards
    output_json: str | None = None

    def check(self) -> None:
        if self.preset not in PRESET_MODELS:
            raise ValueError(f"--preset must be one of {', '.join(PRESET_MODELS)}, got {self.preset!r}")
        for name in ("input_len", "output_len", "num_prompts", "max_num_seqs",
                     "max_num_batched_tokens", "lora_rank", "rows_per_unit"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ValueError(f"--prefix-len must be >= 0, got {self.prefix_len}")
        if not 0.0 <= self.lora_fraction <= 1.0:
            raise ValueError(f"--lora-fraction must be in [0, 1], got {self.lora_fraction}")
        if self.num_adapters < 0:
            raise ValueError(f"--num-adapters must be >= 0, got {self.num_adapters}")
        if self.lora_fraction > 0 and self.num_adapters == 0:
            raise ValueError(f"--lora-fraction {self.lora_fraction} needs --num-adapters >= 1 "
                             "(or set --lora-fraction 0)")
        if self.engine_warmup_rows < 0:
            raise ValueError(f"--engine-warmup-rows must be >= 0, got {self.engine_warmup_rows}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        engine_config(model=self.model_preset, **self.engine_section())  # EngineConfig's checks, named by flag

    @property
    def model_preset(self) -> str:
        return PRESET_MODELS[self.preset]

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.input_len

    @property
    def uses_lora(self) -> bool:
        return self.num_adapters > 0 and round(self.lora_fraction * self.num_prompts) > 0

    def engine_section(self) -> dict:
        """The job file's engine: section (EngineConfig fields) these flags make."""
        e = {"device": self.device, "dtype": self.dtype, "max_num_seqs": self.max_num_seqs,
             "kv_cache_dtype": self.kv_cache_dtype,
             "max_num_batched_tokens": self.max_num_batched_tokens,
             "max_model_len": self.prompt_len + self.output_len,
             "gpu_memory_utilization": self.gpu_memory_utilization,
             "enforce_eager": self.enforce_eager,
             "enable_prefix_caching": self.enable_prefix_caching}
        if self.quantization is not None:
            e["quantization"] = self.quantization
        if self.uses_lora:
            e["max_loras"] = self.max_loras or self.num_adapters
            e["max_lora_rank"] = self.lora_rank
        return e


# ---- the workload on disk ---------------------------------------------------------------
def _device(name: str):
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def prepare_files(p: ThroughputParams, root: Path, log=print) -> dict:
    """Model (reused from a kept --workdir when its stamp matches), adapters, inputs, job."""
    model_dir = root / f"model-{p.preset}"
    stamp = {"preset": p.preset, "seed": p.seed, "config": workload.workload_config(p.model_preset)}
    stamp_file = model_dir / STAMP
    reused = stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp
    if reused:
        model_info = {"reused": True}
        log(f"model: reusing {model_dir}")
    else:
        shutil.rmtree(model_dir, ignore_errors=True)
        dev = _device(p.device)
        log(f"model: writing random {p.model_preset} weights to {model_dir} (made on {dev}) ...")
        model_info = workload.write_random_model(model_dir, p.model_preset, dev, seed=p.seed)
        stamp_file.write_text(json.dumps(stamp) + "\n")
        model_info["reused"] = False
        log(f"model: {model_info['bytes'] / (1 << 30):.2f} GiB in {len(model_info['files'])} "
            f"file(s), {model_info['write_s']:.1f} s")
    adapters: dict[str, str] = {}
    if p.uses_lora:
        shutil.rmtree(root / "adapters", ignore_errors=True)
        adapters = workload.write_workload_adapters(root / "adapters", p.model_preset,
                                                    p.num_adapters, p.lora_rank, p.seed)
    cfg = workload.workload_config(p.model_preset)
    inputs = workload.make_inputs(p.num_prompts, p.input_len, cfg["vocab_size"],
                                  sorted(adapters), p.lora_fraction if p.uses_lora else 0.0, p.seed,
                                  prefix_len=p.prefix_len)
    shutil.rmtree(root / "inputs", ignore_errors=True)
    workload.write_inputs(root / "inputs", inputs)
    out_dir = root / "job-out"
    shutil.rmtree(out_dir, ignore_errors=True)
    job = workload.write_job(root / "job.yaml", model=model_dir, adapters=adapters,
                             inputs=root / "inputs", output=out_dir, output_len=p.output_len,
                             engine=p.engine_section(), rows_per_unit=p.rows_per_unit)
    return {"root": str(root), "model_dir": str(model_dir), "model": model_info,
            "adapters": adapters, "job": str(job), "output_dir": str(out_dir),
            "rows": len(inputs.ids), "lora_rows": inputs.num_lora_rows, "ids": inputs.ids}


# ---- subprocesses -----------------------------------------------------------------------
def run_stamped(cmd: list[str], env: dict | None = None, keep: int = 400) -> dict:
    """Run cmd; wall seconds spawn -> exit, and every output line with its arrival time
    (seconds after spawn). keep: the last this-many lines are kept."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1, env=env)
    lines: list[tuple[float, str, str]] = []
    lock = threading.Lock()

    def pump(stream, name):
        for line in stream:
            with lock:
                lines.append((round(time.time() - t0, 3), name, line.rstrip("\n")))

    threads = [threading.Thread(target=pump, args=(proc.stdout, "stdout"), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, "stderr"), daemon=True)]
    for t in threads:
        t.start()
    rc = proc.wait()
    for t in threads:
        t.join()
    wall = time.time() - t0
    lines.sort(key=lambda x: x[0])
    return {"cmd": cmd, "rc": rc, "spawn_time": t0, "wall_s": wall, "lines": lines[-keep:]}


def _child_env() -> dict:
    """The children import this checkout's batchrun, whatever the caller's cwd."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _tail(run: dict, n: int = 15) -> str:
    return "\n".join(f"  [{s:7.2f}s {name}] {line}" for s, name, line in run["lines"][-n:])


def measure_engine(job: str, root: Path, warmup_rows: int = 0) -> dict:
    out = root / "engine-alone.json"
    run = run_stamped([sys.executable, "-m", "batchrun.bench.engine_alone", job, str(out),
                       str(warmup_rows)], env=_child_env())
    if run["rc"] != 0:
        raise RuntimeError(f"engine-alone run failed (exit {run['rc']}):\n{_tail(run)}")
    return {**json.loads(out.read_text()), "process_wall_s": run["wall_s"]}


def measure_job(job: str, output_dir: str) -> dict:
    run = run_stamped([sys.executable, "-m", "batchrun", "run", job, "--progress", "log",
                       "--log-interval", "10"], env=_child_env())
    if run["rc"] != 0:
        raise RuntimeError(f"`batchrun run` failed (exit {run['rc']}):\n{_tail(run)}")
    return {**run, **job_breakdown(run, output_dir)}


def job_breakdown(run: dict, output_dir: str) -> dict:
    """Phases of the job process. From the run's metrics file when it has the fields; else
    from the stamped output lines (first "task N/M:" line = checks and plan done)."""
    from batchrun.job.store.layout import OutputDir
    wall = run["wall_s"]
    path = Path(OutputDir(output_dir).task_metrics_dir) / "task-0.json"
    m = json.loads(path.read_text()) if path.is_file() else {}
    need = ("started", "elapsed_s", "startup_s", "model_load_s", "writing_s")
    if all(isinstance(m.get(k), (int, float)) for k in need):
        before_run_job = m["started"] - run["spawn_time"]  # interpreter, imports, CLI, job file
        checks = max(m["startup_s"] - m["model_load_s"], 0.0)  # validate, plan, manifest, lock
        gen = max(m["elapsed_s"] - max(m["startup_s"], m["model_load_s"]) - m["writing_s"], 0.0)
        return {"source": f"runner metrics ({path.name}: started, startup_s, model_load_s, "
                          "writing_s, elapsed_s) + process wall time measured outside",
                "phases": {"process_wall_s": wall,
                           "before_task_s": before_run_job + checks,
                           "imports_cli_s": before_run_job, "checks_plan_s": checks,
                           "weight_load_s": m["model_load_s"],
                           "generation_s": gen, "writing_s": m["writing_s"],
                           "exit_s": wall - before_run_job - m["elapsed_s"]},
                "metrics": {k: m.get(k) for k in (*need, "input_rows", "output_rows", "error_rows", "prompt_tokens",
                                                  "output_tokens", "units_done")}}
    task_line = next((s for s, _, line in run["lines"] if line.startswith("task 0/")), None)
    return {"source": "stderr line timestamps (the metrics file lacks "
                      f"{[k for k in need if k not in m]}): before_task_s = first 'task 0/1:' line",
            "phases": {"process_wall_s": wall, "before_task_s": task_line,
                       "weight_load_s": None, "generation_s": None},
            "metrics": m}


def check_output(output_dir: str, ids: list[int], output_len: int) -> dict:
    """Every input id exactly once; error rows; rows that stopped before output_len; the
    outputs' digest (None when the part files have no output_token_ids)."""
    import pyarrow.parquet as pq
    parts = sorted(Path(output_dir).glob("part-*.parquet"))
    got: list[int] = []
    errors = short = tokens = 0
    outputs: list | None = []
    for f in parts:
        t = pq.read_table(f)
        got += t.column("id").to_pylist()
        errors += sum(r == "error" for r in t.column("finish_reason").to_pylist())
        outs = t.column("output_tokens").to_pylist()
        short += sum(n != output_len for n in outs)
        tokens += sum(outs)
        if outputs is not None and "output_token_ids" in t.column_names:
            outputs += zip(t.column("id").to_pylist(), t.column("output_token_ids").to_pylist())
        else:
            outputs = None
    counts: dict[int, int] = {}
    for i in got:
        counts[i] = counts.get(i, 0) + 1
    want = set(ids)
    return {"part_files": len(parts), "rows": len(got), "missing_ids": len(want - counts.keys()),
            "duplicate_ids": sum(c > 1 for c in counts.values()),
            "unexpected_ids": len(counts.keys() - want),
            "every_id_once": counts.keys() == want and all(c == 1 for c in counts.values()),
            "error_rows": errors, "rows_not_at_output_len": short, "output_tokens": tokens,
            "outputs_sha256": outputs_digest(outputs) if outputs is not None else None}


# ---- the benchmark ----------------------------------------------------------------------
def run_throughput(p: ThroughputParams, log=print, command: str | None = None) -> dict:
    from batchrun.bench.record import environment, write_json
    p.check()
    tmp = None
    if p.workdir:
        root = Path(p.workdir).resolve()
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="batchrun-bench-throughput-")
        root = Path(tmp)
    try:
        log("*** " + RANDOM_NOTE.format(preset=p.model_preset) + " ***")
        files = prepare_files(p, root, log)
        shared = f"{p.prefix_len} shared + " if p.prefix_len else ""
        log(f"inputs: {files['rows']} prompts of {shared}{p.input_len} words (= tokens), "
            f"{files['lora_rows']} over {len(files['adapters'])} adapter(s); job {files['job']}")
        log("(a) engine alone (one generate call, own process) ...")
        eng = measure_engine(files["job"], root, p.engine_warmup_rows)
        log(f"    generate {eng['generate_s']:.2f} s (load {eng['load_s']:.1f} s)")
        log("(b) batchrun run job.yaml (subprocess) ...")
        job = measure_job(files["job"], files["output_dir"])
        check = check_output(files["output_dir"], files["ids"], p.output_len)
        log(f"    process {job['wall_s']:.2f} s")
        result = {"benchmark": "throughput", **environment(_device(p.device), command),
                  "weights": "random", "note": RANDOM_NOTE.format(preset=p.model_preset),
                  "model": p.model_preset, "args": asdict(p),
                  # the switches the engine-alone and job processes read (they inherit the env)
                  "experiments": asdict(Experiments.from_env()),
                  "workload": {k: v for k, v in files.items() if k != "ids"},
                  "engine_alone": eng,
                  "job": {k: job[k] for k in ("cmd", "rc", "wall_s", "source", "phases",
                                              "metrics", "lines")},
                  "output_check": check}
        result.update(summarize(p, eng, job["phases"], check))
        from batchrun.bench.roofline import offline_floor
        from batchrun.engine.models.config import ModelConfig
        floor = offline_floor(ModelConfig.from_dict(workload.workload_config(p.model_preset)),
                              p.num_prompts, p.prompt_len, p.output_len, p.max_num_seqs,
                              result.get("device") or "", fp8_weights=p.quantization == "fp8",
                              fp8_kv=p.kv_cache_dtype == "fp8")
        if floor is not None:
            floor["engine_alone_fraction"] = result["throughput_tok_s"]["engine_alone"] / floor["tok_s"]
            log(f"    engine alone at {floor['engine_alone_fraction']:.1%} of the workload's "
                f"floor ({floor['tok_s']:.0f} tok/s on this card)")
        result["offline_floor"] = floor
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    write_json(p.output_json, result)
    return result
