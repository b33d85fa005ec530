"""`batchrun bench throughput` on the tiny preset (CPU): the real files, the engine-alone child
and the `batchrun run` subprocess end to end; JSON fields and the output check."""
import json

import pytest
from click.testing import CliRunner

from batchrun.bench import workload
from batchrun.bench.throughput import ThroughputParams, check_output, prepare_files
from batchrun.cli import main


@pytest.mark.slow
def test_throughput_tiny_end_to_end(tmp_path):
    out = tmp_path / "tp.json"
    args = ["bench", "throughput", "--preset", "tiny", "--device", "cpu", "--input-len", "8",
            "--output-len", "4", "--num-prompts", "20", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "64", "--num-adapters", "2", "--lora-rank", "4",
            "--rows-per-unit", "6", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "RANDOM WEIGHTS" in res.output and "job generation / engine alone" in res.output
    r = json.loads(out.read_text())
    assert r["benchmark"] == "throughput" and r["weights"] == "random" and "RANDOM" in r["note"]
    assert r["commit"] and r["versions"]["torch"] and r["command"].startswith("batchrun bench throughput")
    assert r["args"]["num_prompts"] == 20 and r["args"]["lora_fraction"] == 0.5
    assert r["workload"]["lora_rows"] == 10 and len(r["workload"]["adapters"]) == 2
    # (a) engine alone: every row, one call, exactly output-len tokens each
    e = r["engine_alone"]
    assert e["rows"] == 20 and e["error_rows"] == 0 and e["output_tokens_per_row"] == [4]
    assert e["generate_s"] > 0 and e["load_s"] > 0
    assert e["warmup_rows"] == 32 and e["warmup_s"] > 0  # default warm-up, untimed
    st = e["engine_stats"]  # the timed call's steps, timed by kind (not the warm-up's)
    assert st["decode_steps"] > 0 and 0 < st["decode_host_s"] <= st["decode_s"]
    assert st["prefill_s"] + st["mixed_s"] + st["decode_s"] <= e["generate_s"]
    assert "engine alone step time: prefill" in res.output
    # (b) the job subprocess, broken down from its own metrics file
    j = r["job"]
    assert j["rc"] == 0 and "runner metrics" in j["source"]
    ph = j["phases"]
    for k in ("process_wall_s", "before_task_s", "weight_load_s", "generation_s", "writing_s"):
        assert ph[k] is not None and ph[k] >= 0, k
    assert ph["before_task_s"] + ph["weight_load_s"] + ph["generation_s"] <= ph["process_wall_s"]
    assert j["metrics"]["output_rows"] == 20 and any("summary" in line for _, _, line in j["lines"])
    # output: every id exactly once, nothing short
    c = r["output_check"]
    assert c["every_id_once"] and c["rows"] == 20 and c["missing_ids"] == 0
    assert c["duplicate_ids"] == 0 and c["error_rows"] == 0 and c["rows_not_at_output_len"] == 0
    assert c["part_files"] >= 4  # 10 base rows / 6 + 2 adapters x 5 rows
    # (c) tok/s = (in + out) * N / time, and the ratios
    assert r["tokens"]["tokens_as_asked"] and r["tokens"]["as_asked"] == (8 + 4) * 20
    tp = r["throughput_tok_s"]
    assert tp["engine_alone"] == pytest.approx(240 / e["generate_s"])
    assert tp["job_generation"] == pytest.approx(240 / ph["generation_s"])
    assert r["ratios"]["job_generation_over_engine"] == pytest.approx(ph["generation_s"] / e["generate_s"])
    # a kept workdir reuses its model (same preset and seed); inputs and job are rewritten
    again = prepare_files(ThroughputParams(preset="tiny", device="cpu", num_prompts=6,
                                           input_len=8, output_len=4, num_adapters=2, lora_rank=4),
                          tmp_path / "work", log=lambda m: None)
    assert again["model"] == {"reused": True} and again["rows"] == 6
    assert not (tmp_path / "work" / "job-out").exists()


def test_check_output_catches_duplicates_and_missing(tmp_path):
    inputs = workload.Inputs([1, 2, 3], ["w100"] * 3, [None] * 3)
    import pyarrow as pa
    import pyarrow.parquet as pq
    t = pa.table({"id": [1, 1], "finish_reason": ["length", "length"], "output_tokens": [4, 3]})
    pq.write_table(t, tmp_path / "part-000000.parquet")
    c = check_output(str(tmp_path), inputs.ids, 4)
    assert not c["every_id_once"] and c["missing_ids"] == 2 and c["duplicate_ids"] == 1
    assert c["rows_not_at_output_len"] == 1


def test_word_tokenizer_and_inputs(tmp_path):
    from transformers import AutoTokenizer
    workload.write_word_tokenizer(tmp_path, 300, max_len=64)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    inp = workload.make_inputs(10, 7, 300, ["a", "b"], 0.5, seed=1)
    ids = tok(inp.prompts)["input_ids"]
    assert all(len(x) == 7 and min(x) >= 100 for x in ids)  # N words = N tokens, no BOS
    assert tok.eos_token_id is None
    assert inp.num_lora_rows == 5 and {a for a in inp.adapters if a} == {"a", "b"}
    assert "eos_token_id" not in workload.workload_config("llama-2-7b")


def test_throughput_flag_errors():
    for bad, msg in (({"lora_fraction": 1.5}, "--lora-fraction"),
                     ({"num_adapters": 0}, "needs --num-adapters"),
                     ({"preset": "13b"}, "--preset")):
        with pytest.raises(ValueError, match=msg):
            ThroughputParams(**bad).check()
    ThroughputParams(num_adapters=0, lora_fraction=0.0).check()


@pytest.mark.slow
def test_throughput_shared_prefix_caching_on_and_off(tmp_path):
    """--prefix-len: every prompt starts with the same tokens; with caching on the engine finds
    them cached (hit rate printed), and both settings give the same outputs (digests)."""
    runs = {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        out = tmp_path / f"{flag}.json"
        args = ["bench", "throughput", "--preset", "tiny", "--device", "cpu", "--prefix-len", "37",
                "--input-len", "3", "--output-len", "4", "--num-prompts", "10", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "64", "--num-adapters", "1", "--lora-rank", "4",
                "--engine-warmup-rows", "2", "--rows-per-unit", "10", flag,
                "--workdir", str(tmp_path / "work"), "--out", str(out)]
        res = CliRunner().invoke(main, args, catch_exceptions=False)
        assert res.exit_code == 0, res.output
        runs[flag] = (res.output, json.loads(out.read_text()))
    text, on = runs["--enable-prefix-caching"]
    assert "37 shared + 3 in" in text and "hit rate" in text
    assert on["args"]["prefix_len"] == 37 and on["tokens"]["tokens_as_asked"]
    assert on["tokens"]["as_asked"] == (37 + 3 + 4) * 10
    pc = on["prefix_cache"]
    assert pc["enabled"] and pc["queried_tokens"] == 40 * 10
    # base rows and the adapter's rows each compute the two shared full blocks once (the
    # warm-up's entries were dropped): at most 8 of 10 rows hit, 32 tokens each
    assert 0 < pc["hit_tokens"] <= 8 * 32 and pc["hit_rate"] == pc["hit_tokens"] / 400
    assert on["outputs"]["engine_equals_job"] is True
    text, off = runs["--no-enable-prefix-caching"]
    assert "prefix cache: off" in text and off["prefix_cache"]["hit_tokens"] == 0
    assert off["outputs"]["job_sha256"] == on["outputs"]["job_sha256"]
    assert off["output_check"]["outputs_sha256"] == on["output_check"]["outputs_sha256"]


def test_inputs_with_a_shared_prefix():
    plain = workload.make_inputs(4, 5, 300, [], 0.0, seed=2)
    pre = workload.make_inputs(4, 5, 300, [], 0.0, seed=2, prefix_len=6)
    heads = {" ".join(p.split()[:6]) for p in pre.prompts}
    assert len(heads) == 1 and all(len(p.split()) == 11 for p in pre.prompts)
    assert [" ".join(p.split()[6:]) for p in pre.prompts] == plain.prompts  # own words unchanged
