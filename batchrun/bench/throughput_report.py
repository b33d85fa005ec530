"""What `batchrun bench throughput` prints from its result."""
from __future__ import annotations


def _f(v, spec=".2f", unit="") -> str:
    return "n/a" if v is None else format(v, spec) + unit


def print_throughput(r: dict, echo=print) -> None:
    a, ph, t = r["args"], r["job"]["phases"], r["throughput_tok_s"]
    echo("*** " + r["note"] + " ***")
    echo(f"{r['model']} on {r['device']}, commit {r['commit'][:12]}"
         f"{' (dirty)' if r.get('git_dirty') else ''}; {a['num_prompts']} prompts x "
         f"({a['input_len']} in + {a['output_len']} out), max_num_seqs {a['max_num_seqs']}, "
         f"max_num_batched_tokens {a['max_num_batched_tokens']}; "
         f"{r['workload']['lora_rows']} rows over {a['num_adapters']} rank-{a['lora_rank']} adapters")
    rows = [("engine alone: generate (one call)", r["engine_alone"]["generate_s"], t["engine_alone"]),
            ("  (its load: weights, KV, graphs)", r["engine_alone"]["load_s"], None),
            ("batchrun run: whole process", ph["process_wall_s"], t["job_process"]),
            ("  before the task starts", ph.get("before_task_s"), None),
            ("    imports + CLI + job file", ph.get("imports_cli_s"), None),
            ("    checks, plan, manifest", ph.get("checks_plan_s"), None),
            ("  engine load (imports, weights, KV, graphs)", ph.get("weight_load_s"), None),
            ("  generation", ph.get("generation_s"), t["job_generation"]),
            ("  writing part files", ph.get("writing_s"), None)]
    echo(f"{'what':<44}{'seconds':>10}{'tok/s':>12}")
    for name, s, rate in rows:
        echo(f"{name:<44}{_f(s):>10}{_f(rate, '.0f'):>12}")
    ra = r["ratios"]
    echo(f"job generation / engine alone: {_f(ra['job_generation_over_engine'], '.3f', ' x')}; "
         f"job process / engine alone: {_f(ra['job_process_over_engine'], '.3f', ' x')}")
    echo(f"phases from: {r['job']['source']}")
    c = r["output_check"]
    echo(f"output: {c['rows']} rows in {c['part_files']} part file(s); every id once: "
         f"{'yes' if c['every_id_once'] else 'NO'} (missing {c['missing_ids']}, duplicated "
         f"{c['duplicate_ids']}); error rows {c['error_rows']}; rows short of --output-len "
         f"{c['rows_not_at_output_len']}; tokens as asked: {'yes' if r['tokens']['tokens_as_asked'] else 'NO'}")
