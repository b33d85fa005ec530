"""`bench throughput`'s engine-alone measurement, run as its own process:

    python -m batchrun.bench.engine_alone JOB.yaml RESULT.json [WARMUP_ROWS]

The engine is the one `batchrun run JOB.yaml` builds (runner.load_engine on the same JobSpec),
the requests are the job's rows tokenized by the engine's tokenizer with the job's sampling
(greedy, max_tokens) and adapters, all in ONE timed `engine.generate` call (after an untimed
warm-up of a few of the rows, unless WARMUP_ROWS is 0). A process of its own, so
its GPU memory is gone before the job runs, and both measurements start from the same state.
"""
from __future__ import annotations

import json
import sys
import time


def measure(job_path: str, warmup_rows: int = 0) -> dict:
    """warmup_rows > 0: first an untimed generate of that many of the rows (4 output tokens
    each), so the timed call finds Triton's kernels compiled (a cold first call pays for it)."""
    t_start = time.time()
    import pyarrow.dataset as ds
    import torch

    from batchrun.engine.config import SamplingParams
    from batchrun.engine.request import Request
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.inputs.rows import row_seed
    from batchrun.job.run.runner import load_engine
    t_imported = time.time()
    spec = load_job(job_path)
    inp = spec.input
    table = ds.dataset(inp.path, format="parquet").to_table(
        columns=[inp.id_column, inp.prompt_column, inp.adapter_column])
    ids = table.column(inp.id_column).to_pylist()
    prompts = table.column(inp.prompt_column).to_pylist()
    adapters = table.column(inp.adapter_column).to_pylist()
    t0 = time.time()
    engine = load_engine(spec)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t_loaded = time.time()
    token_ids = engine.tokenizer(prompts)["input_ids"]
    s = spec.sampling
    reqs = [Request(i, list(t), SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature,
                                               top_p=s.top_p, top_k=s.top_k,
                                               seed=row_seed(s.seed, rid)), a or None)
            for i, (rid, t, a) in enumerate(zip(ids, token_ids, adapters))]
    t_tok = time.time()
    warm_s = None
    if warmup_rows > 0:
        w0 = time.perf_counter()
        engine.generate([Request(f"warmup{r.request_id}", r.prompt_token_ids,
                                 SamplingParams(max_tokens=min(4, s.max_tokens)), r.adapter)
                         for r in reqs[:warmup_rows]])
        if cuda:
            torch.cuda.synchronize()
        warm_s = time.perf_counter() - w0
    engine.blocks.reset_cache()  # the timed call starts with an empty prefix cache, like the job
    stats0 = dict(engine.stats)
    if cuda:
        torch.cuda.synchronize()
    g0 = time.perf_counter()
    results = engine.generate(reqs)
    if cuda:
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - g0
    errors = [r.error for r in results if r.finish_reason == "error"]
    from batchrun.bench.throughput_report import outputs_digest
    return {
        "process_to_imports_s": t_imported - t_start,
        "load_s": t_loaded - t0,  # weights, KV cache, CUDA-graph capture
        "tokenize_s": t_tok - t_loaded,
        "warmup_rows": warmup_rows, "warmup_s": warm_s,
        "generate_s": gen_s,
        "rows": len(results), "error_rows": len(errors), "first_error": errors[0] if errors else None,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "output_tokens": sum(len(r.output_token_ids) for r in results),
        "output_tokens_per_row": sorted({len(r.output_token_ids) for r in results}),
        "outputs_sha256": outputs_digest([(rid, r.output_token_ids) for rid, r in zip(ids, results)]),
        "device": str(engine.device), "dtype": str(engine.dtype),
        "graphs": engine.runner.graphs is not None,
        "kv_blocks": engine.blocks.num_blocks,
        "engine_stats": {k: v - stats0.get(k, 0) if isinstance(v, (int, float)) else v
                         for k, v in engine.stats.items()},
    }


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python -m batchrun.bench.engine_alone JOB.yaml RESULT.json [WARMUP_ROWS]",
              file=sys.stderr)
        return 2
    result = measure(argv[0], int(argv[2]) if len(argv) == 3 else 0)
    with open(argv[1], "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
