"""sampling: fields in job.yaml: validation naming the field, generation_config.json defaults,
override precedence (generation_config -> job.yaml -> row column), sampling.overrides modes."""
import json

import pytest

from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import parse_job
from batchrun.job.inputs.rows import _sampling

MIN = {"model": "m", "input": {"path": "in.parquet"}, "output": {"path": "out"}}


def spec(sampling=None, model_dir=None, **inp):
    raw = {**MIN, "input": {**MIN["input"], **inp}, "sampling": sampling or {}}
    if model_dir:
        raw["model"] = str(model_dir)
    return parse_job(raw, base_dir="/jobs")


def err(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        spec(**kw)
    return str(e.value)


def test_defaults():
    s = spec().sampling
    assert (s.n, s.stop, s.stop_token_ids, s.ignore_eos, s.min_tokens, s.logprobs, s.overrides) == \
        (1, (), (), False, 0, None, "auto")
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.0, 0.0, 1.0)


def test_stop_accepts_a_string_or_a_list():
    assert spec({"stop": "###"}).sampling.stop == ("###",)
    assert spec({"stop": ["a b", "\n\n"], "stop_token_ids": [5, 9]}).sampling.stop == ("a b", "\n\n")


@pytest.mark.parametrize("sampling, needle", [
    ({"n": 0}, "sampling.n: must be >= 1"),
    ({"stop": [""]}, "sampling.stop: expected a string or a list of non-empty strings"),
    ({"stop": 3}, "sampling.stop: expected a string or a list"),
    ({"stop_token_ids": [-1]}, "sampling.stop_token_ids: expected a list of token ids"),
    ({"min_tokens": 9, "max_tokens": 8}, "sampling.min_tokens: must be <= max_tokens (8), got 9"),
    ({"min_tokens": -1}, "sampling.min_tokens: must be >= 0"),
    ({"presence_penalty": 2.5}, "sampling.presence_penalty: must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "sampling.frequency_penalty: must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "sampling.repetition_penalty: must be > 0"),
    ({"logprobs": 21}, "sampling.logprobs: must be null (none) or an integer in [0, 20]"),
    ({"logprobs": -1}, "sampling.logprobs: must be null"),
    ({"ignore_eos": "yes"}, "sampling.ignore_eos: expected true or false"),
    ({"overrides": "none"}, "sampling.overrides: expected auto, or a list of column names"),
    ({"overrides": ["n"]}, "sampling.overrides: 'n' is not a per-row sampling field"),
    ({"temperature": -0.5}, "sampling.temperature: must be a finite number >= 0"),
])
def test_bad_values_name_the_field(sampling, needle):
    assert needle in err(sampling=sampling)


def _model(tmp_path, gen):
    d = tmp_path / "model"
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def test_generation_config_gives_defaults_job_yaml_wins(tmp_path):
    d = _model(tmp_path, {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                          "max_new_tokens": 99, "do_sample": True})
    s = spec({"top_p": 0.5}, model_dir=d).sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_tokens) == (0.6, 0.5, 20, 1.1, 99)
    assert set(s.from_generation_config) == {"temperature", "top_k", "repetition_penalty", "max_tokens"}


def test_generation_config_bad_value_names_the_file(tmp_path):
    d = _model(tmp_path, {"top_p": 1.5})
    msg = err(sampling={}, model_dir=d)
    assert "sampling.top_p: must be in (0, 1], got 1.5 (from the model's generation_config.json)" in msg
    assert spec({"top_p": 1.0}, model_dir=d).sampling.top_p == 1.0  # job.yaml overrides it


def test_row_overrides_win_over_job_values():
    s = spec({"temperature": 0.5, "stop": ["x"], "min_tokens": 2, "logprobs": 1})
    rows = {"temperature": [None, 1.5], "stop": [None, ["yy", "z"]], "logprobs": [None, 4],
            "ignore_eos": [None, True], "stop_token_ids": [None, [7]]}
    cols = list(rows)
    a = _sampling(s, rows, 0, "r0", cols)
    b = _sampling(s, rows, 1, "r1", cols)
    assert (a.temperature, a.stop, a.logprobs, a.ignore_eos, a.stop_token_ids) == (0.5, ("x",), 1, False, ())
    assert (b.temperature, b.stop, b.logprobs, b.ignore_eos, b.stop_token_ids) == (1.5, ("yy", "z"), 4, True, (7,))
    assert b.min_tokens == 2
    # only the listed override columns count (the plan lists what sampling.overrides selected)
    c = _sampling(s, rows, 1, "r1", ["logprobs"])
    assert (c.temperature, c.logprobs) == (0.5, 4)


@pytest.mark.parametrize("rows, needle", [
    ({"min_tokens": [100]}, "min_tokens must be <= max_tokens"),
    ({"repetition_penalty": [float("nan")]}, "repetition_penalty must be > 0"),
    ({"logprobs": [50]}, "logprobs must be null (none) or an integer in [0, 20]"),
    ({"stop": [[""]]}, "stop strings must be non-empty"),
])
def test_bad_row_overrides_raise(rows, needle):
    with pytest.raises(ValueError) as e:
        _sampling(spec(), rows, 0, "r", list(rows))
    assert needle in str(e.value)
