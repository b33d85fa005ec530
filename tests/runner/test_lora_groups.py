"""LoRA units of several adapters share the engine's batch (up to engine.max_loras adapters).

The runner streams units into the engine (``Engine.generate_stream``); the scheduler admits rows
of up to ``max_loras`` adapters at once (LoRA slots), so steps hold rows of several adapters and
the batch does not drain at every adapter boundary. Outputs must not change: the same job with
max_loras 1 (one adapter at a time) gives the same tokens. (Before the streaming feeder this
test also checked one ``generate`` call per group and no base rows in a LoRA step; a base->LoRA
boundary now overlaps on purpose, and each step's LoRA flag is checked instead.)
"""
import dataclasses

import pytest

from batchrun.job.jobfile.spec import OutputSpec, load_job
from batchrun.job.run.runner import load_engine, run_job
from tests.helpers.jobs import read_output, REPO

DEMO_JOB = REPO / "jobs" / "demo.yaml"
HAVE_DEMO = (REPO / "demo" / "model" / "config.json").is_file()


def _run(tmp_path, name, max_loras):
    spec = load_job(DEMO_JOB)
    spec = dataclasses.replace(spec, output=OutputSpec(str(tmp_path / name)),
                               engine=dataclasses.replace(spec.engine, max_loras=max_loras, max_num_seqs=64))
    steps, flags = [], []

    def factory(s):
        engine = load_engine(s)
        orig_step, orig_forward = engine.runner.decode, engine.runner.decode_forward

        def decode(batch, prev=None):
            steps.append({q.adapter for q in batch.seqs})
            return orig_step(batch, prev)

        def decode_forward(rows, lora):  # the CPU engine runs every decode step eagerly
            flags.append(lora is not None)  # the LoRA path ran (False: the no-LoRA path)
            return orig_forward(rows, lora)
        engine.runner.decode = decode
        engine.runner.decode_forward = decode_forward
        return engine
    run_job(spec, engine_factory=factory, progress=False, log=lambda m: None)
    out = {r["id"]: (r["adapter"], r["output_token_ids"]) for r in read_output(tmp_path / name).to_pylist()}
    return out, steps, flags


@pytest.mark.skipif(not HAVE_DEMO, reason="demo assets not built (python scripts/train_demo.py)")
def test_adapters_share_steps_and_outputs_match_one_adapter_at_a_time(tmp_path):
    packed, steps, flags = _run(tmp_path, "packed", max_loras=2)
    single, steps1, flags1 = _run(tmp_path, "single", max_loras=1)
    assert any(s >= {"reverse", "upper"} for s in steps), "no decode step held rows of both adapters"
    assert not any(len(s - {None}) > 1 for s in steps1)  # one LoRA slot: one adapter at a time
    for s, has_lora in zip(steps + steps1, flags + flags1):  # a step without adapter rows: no LoRA ops
        assert has_lora == (s != {None})
    assert packed == single and len(packed) > 0
