"""The demo job streamed through the real CPU engine: consecutive units and engine groups share
decode steps (the batch does not drain at a group or shard boundary), and the streamed tokens
equal those of the engine driven one ``generate(list)`` call per engine group."""
import dataclasses

import pytest

from batchrun.job.jobfile.spec import OutputSpec, load_job
from batchrun.job.plan.units import Plan, engine_groups, group_rows
from batchrun.job.run.runner import load_engine, run_job
from tests.helpers.jobs import read_output, REPO

DEMO_JOB = REPO / "jobs" / "demo.yaml"
HAVE_DEMO = (REPO / "demo" / "model" / "config.json").is_file()


class PerGroup:
    """The reference: the engine driven one ``generate(list)`` call per engine group of the plan,
    so its batch drains at every group boundary (how the runner ran before it streamed)."""

    def __init__(self, engine, group_of: dict[int, int]):
        self._engine, self._group_of = engine, group_of
        self.calls = 0

    def generate_stream(self, source, on_result):
        batch = []

        def run_batch():
            if batch:
                self.calls += 1
                self._engine.generate(batch, on_result=on_result)
                batch.clear()
        while (got := source.take(1, wait=True)) is not None:
            for req in got:
                if batch and self._group_of[req.request_id[0]] != self._group_of[batch[0].request_id[0]]:
                    run_batch()
                batch.append(req)
        run_batch()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _run(tmp_path, name, streamed):
    spec = load_job(DEMO_JOB)
    spec = dataclasses.replace(spec, output=OutputSpec(str(tmp_path / name)),
                               engine=dataclasses.replace(spec.engine, device="cpu", max_num_seqs=16))
    steps, engines = [], []

    def factory(s):
        engine = load_engine(s)
        orig = engine.runner.decode

        def decode(batch, prev=None):
            steps.append({q.request_id[0] for q in batch.seqs})  # request ids are (unit, row)
            return orig(batch, prev)
        engine.runner.decode = decode
        if not streamed:
            plan = Plan.load(str(tmp_path / name / "_batchrun" / "plan"))
            groups = engine_groups(plan.units, group_rows(s.engine.max_num_seqs), s.engine.max_loras)
            engine = PerGroup(engine, {u.index: g for g, us in enumerate(groups) for u in us})
        engines.append(engine)
        return engine
    run_job(spec, engine_factory=factory, progress=False, log=lambda m: None)
    out = {r["id"]: (r["adapter"], r["output_token_ids"], r["finish_reason"])
           for r in read_output(tmp_path / name).to_pylist()}
    plan = Plan.load(str(tmp_path / name / "_batchrun" / "plan"))
    groups = engine_groups(plan.units, group_rows(spec.engine.max_num_seqs), spec.engine.max_loras)
    group_of = {u.index: g for g, us in enumerate(groups) for u in us}
    return out, [{group_of[u] for u in s} for s in steps], steps, engines[0], len(groups)


@pytest.mark.skipif(not HAVE_DEMO, reason="demo assets not built (python scripts/train_demo.py)")
def test_groups_share_steps_and_tokens_equal_the_per_group_runner(tmp_path):
    streamed, group_steps, unit_steps, _, n_groups = _run(tmp_path, "stream", streamed=True)
    listed, group_steps1, _, list_engine, _ = _run(tmp_path, "list", streamed=False)
    assert n_groups >= 2
    assert list_engine.calls == n_groups  # the reference really ran one generate per group
    assert not any(len(s) > 1 for s in group_steps1)  # ... so its steps drain at group boundaries
    assert any(len(s) > 1 for s in group_steps), "no decode step held rows of two engine groups"
    assert any(len(s) > 2 for s in unit_steps)  # and several units share steps
    assert streamed == listed and len(streamed) > 0
