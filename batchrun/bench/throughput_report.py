"""`bench throughput`'s summary (tokens, tok/s, ratios, prefix-cache hit rate, output digests)
and its printed report, from the measurements throughput.py makes."""
from __future__ import annotations


def outputs_digest(rows) -> str:
    """sha256 over (id, output token ids) pairs in id order: equal for two runs exactly when
    every row generated the same tokens."""
    import hashlib
    h = hashlib.sha256()
    for rid, toks in sorted(rows, key=lambda r: r[0]):
        h.update(f"{rid}:{','.join(map(str, toks))};".encode())
    return h.hexdigest()



def tok_per_s(tokens: int, seconds: float | None) -> float | None:
    return tokens / seconds if seconds else None


def summarize(p, eng: dict, phases: dict, check: dict) -> dict:
    asked = (p.prompt_len + p.output_len) * p.num_prompts
    eng_tokens = eng["prompt_tokens"] + eng["output_tokens"]
    job_tokens = p.prompt_len * check["rows"] + check["output_tokens"]
    gen, wall = phases.get("generation_s"), phases["process_wall_s"]
    st = eng.get("engine_stats", {})
    queried = st.get("prefix_cache_queried_tokens", 0)
    digests = (eng.get("outputs_sha256"), check.get("outputs_sha256"))
    return {"tokens": {"as_asked": asked, "engine_alone": eng_tokens, "job": job_tokens,
                       "tokens_as_asked": eng_tokens == asked == job_tokens},
            "prefix_cache": {"enabled": p.enable_prefix_caching, "queried_tokens": queried,
                             "hit_tokens": st.get("prefix_cache_hit_tokens", 0),
                             "hit_rate": st.get("prefix_cache_hit_tokens", 0) / queried if queried else None},
            "outputs": {"engine_alone_sha256": digests[0], "job_sha256": digests[1],
                        "engine_equals_job": digests[0] == digests[1] if None not in digests else None},
            "throughput_tok_s": {"engine_alone": tok_per_s(eng_tokens, eng["generate_s"]),
                                 "job_generation": tok_per_s(job_tokens, gen),
                                 "job_process": tok_per_s(job_tokens, wall)},
            "ratios": {"job_generation_over_engine": gen / eng["generate_s"] if gen else None,
                       "job_process_over_engine": wall / eng["generate_s"]}}


def _prompt(a: dict) -> str:
    return f"{a['prefix_len']} shared + {a['input_len']}" if a.get("prefix_len") else str(a["input_len"])


def _sum(*parts):
    return None if None in parts else sum(parts)


def _f(v, spec=".2f", unit="") -> str:
    return "n/a" if v is None else format(v, spec) + unit


def print_throughput(r: dict, echo=print) -> None:
    a, ph, t = r["args"], r["job"]["phases"], r["throughput_tok_s"]
    x = r["experiments"]
    echo("*** " + r["note"] + " ***")
    echo(f"{r['model']} on {r['device']}, commit {r['commit'][:12]}"
         f"{' (dirty)' if r.get('git_dirty') else ''}; {a['num_prompts']} prompts x "
         f"({_prompt(a)} in + {a['output_len']} out), max_num_seqs {a['max_num_seqs']}, "
         f"max_num_batched_tokens {a['max_num_batched_tokens']}, mixed steps "
         f"{'on' if x['mixed_steps'] else 'off'}, async scheduling "
         f"{'on' if x['async_scheduling'] else 'off'}; "
         f"{r['workload']['lora_rows']} rows over {a['num_adapters']} rank-{a['lora_rank']} adapters")
    rows = [("engine alone: generate (one call)", r["engine_alone"]["generate_s"], t["engine_alone"]),
            ("  (its load: weights, KV, graphs)", r["engine_alone"]["load_s"], None),
            ("batchrun run: whole process", ph["process_wall_s"], t["job_process"]),
            ("  before the task starts", ph.get("before_task_s"), None),
            ("    imports + CLI + job file", ph.get("imports_cli_s"), None),
            ("    checks, plan, manifest", ph.get("checks_plan_s"), None),
            ("  engine load (imports, weights, KV, graphs)", ph.get("weight_load_s"), None),
            ("  start -> engine ready (the two above)", _sum(ph.get("before_task_s"), ph.get("weight_load_s")), None),
            ("  generation", ph.get("generation_s"), t["job_generation"]),
            ("  writing part files", ph.get("writing_s"), None)]
    echo(f"{'what':<44}{'seconds':>10}{'tok/s':>12}")
    for name, s, rate in rows:
        echo(f"{name:<44}{_f(s):>10}{_f(rate, '.0f'):>12}")
    ra = r["ratios"]
    echo(f"job generation / engine alone: {_f(ra['job_generation_over_engine'], '.3f', ' x')}; "
         f"job process / engine alone: {_f(ra['job_process_over_engine'], '.3f', ' x')}")
    st = r["engine_alone"].get("engine_stats", {})
    echo("engine alone steps: " + ", ".join(f"{k} {st[k]}" for k in
                                           ("prefill_steps", "mixed_steps", "decode_steps", "preemptions") if k in st))
    if st.get("decode_steps"):
        echo(f"engine alone step time: prefill {st['prefill_s']:.2f} s, mixed {st['mixed_s']:.2f} s, "
             f"decode {st['decode_s']:.2f} s ({1e3 * st['decode_s'] / st['decode_steps']:.2f} ms a "
             f"step, of which host work {1e3 * st['decode_host_s'] / st['decode_steps']:.2f} ms"
             f"{', overlapping the device' if x['async_scheduling'] else ''})")
    echo(f"phases from: {r['job']['source']}")
    pc = r["prefix_cache"]
    if not pc["enabled"]:
        echo("prefix cache: off")
    else:
        echo(f"prefix cache (engine alone): {pc['hit_tokens']} of {pc['queried_tokens']} prompt "
             f"tokens found cached, hit rate {_f(pc['hit_rate'] and 100 * pc['hit_rate'], '.1f', ' %')}")
    o = r["outputs"]
    echo(f"outputs sha256: engine alone {str(o['engine_alone_sha256'])[:16]}, job "
         f"{str(o['job_sha256'])[:16]} (equal: "
         f"{ {True: 'yes', False: 'NO', None: 'n/a'}[o['engine_equals_job']] })")
    c = r["output_check"]
    echo(f"output: {c['rows']} rows in {c['part_files']} part file(s); every id once: "
         f"{'yes' if c['every_id_once'] else 'NO'} (missing {c['missing_ids']}, duplicated "
         f"{c['duplicate_ids']}); error rows {c['error_rows']}; rows short of --output-len "
         f"{c['rows_not_at_output_len']}; tokens as asked: {'yes' if r['tokens']['tokens_as_asked'] else 'NO'}")
