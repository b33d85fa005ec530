"""LoRA units of several adapters share the engine's batch (up to engine.max_loras adapters).

The runner hands the engine one group of units per ``generate`` call; adapter units of up to
``max_loras`` adapters share a group, so steps hold rows of several adapters and the batch does
not drain at every adapter boundary. Outputs must not change: the same job with max_loras 1
(one adapter per call) gives the same tokens.
"""
import dataclasses

import pytest

from batchrun.job import OutputSpec, load_job
from batchrun.runner import load_engine, run_job
from runner_helpers import REPO, read_output

DEMO_JOB = REPO / "jobs" / "demo.yaml"
HAVE_DEMO = (REPO / "demo" / "model" / "config.json").is_file()


def _run(tmp_path, name, max_loras):
    spec = load_job(DEMO_JOB)
    spec = dataclasses.replace(spec, output=OutputSpec(str(tmp_path / name)),
                               engine=dataclasses.replace(spec.engine, max_loras=max_loras, max_num_seqs=64))
    steps, calls = [], []

    def factory(s):
        engine = load_engine(s)
        orig_step, orig_generate = engine.runner.decode, engine.generate

        def decode(seqs):
            steps.append({q.adapter for q in seqs})
            return orig_step(seqs)

        def generate(requests, **kw):
            calls.append(sorted({r.adapter or "" for r in requests}))
            return orig_generate(requests, **kw)
        engine.runner.decode, engine.generate = decode, generate
        return engine
    run_job(spec, engine_factory=factory, progress=False, log=lambda m: None)
    out = {r["id"]: (r["adapter"], r["output_token_ids"]) for r in read_output(tmp_path / name).to_pylist()}
    return out, steps, calls


@pytest.mark.skipif(not HAVE_DEMO, reason="demo assets not built (python scripts/train_demo.py)")
def test_adapters_share_steps_and_outputs_match_one_adapter_at_a_time(tmp_path):
    packed, steps, calls = _run(tmp_path, "packed", max_loras=2)
    single, steps1, calls1 = _run(tmp_path, "single", max_loras=1)
    assert calls == [[""], ["reverse", "upper"]]  # base first, then both adapters in one call
    assert calls1 == [[""], ["reverse"], ["upper"]]
    assert any(s >= {"reverse", "upper"} for s in steps), "no decode step held rows of both adapters"
    assert not any(len(s - {None}) > 1 for s in steps1)
    assert not any(None in s and len(s) > 1 for s in steps)  # base rows never share a LoRA step
    assert packed == single and len(packed) > 0
