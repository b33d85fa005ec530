"""Strings in a job file that are not valid text (invalid UTF-8 bytes, NUL, lone surrogates,
at any depth, in keys or values, or from an environment variable) are ConfigErrors naming the
field, never a traceback or a path that silently means something else."""
import pytest

from batchrun.errors import ConfigError
from batchrun.job.exit_codes import ExitCode
from batchrun.job.jobfile.spec import load_job
from tests.helpers.jobs import run_cli

HEAD = b"model: m\ninput: {path: data, prompt_column: p}\noutput: {path: out}\n"

CASES = [
    ("invalid UTF-8", b'model: "m\xff"\ninput: {path: data, prompt_column: p}\noutput: {path: out}\n',
     r"not valid UTF-8 text: byte 0xff at line 1, column 10; save the job file as UTF-8"),
    ("latin-1 file", 'model: m\ninput: {path: "d\xe9j\xe0", prompt_column: p}\noutput: {path: out}\n'.encode("latin-1"),
     r"not valid UTF-8 text: byte 0xe9 at line 2, column 17"),
    ("UTF-16", HEAD.decode().encode("utf-16"), r"byte 0xff at line 1, column 1 \(the file starts with a UTF-16 "
                                               r"byte-order mark\)"),
    ("NUL in model", b'model: "m\\0x"\ninput: {path: data, prompt_column: p}\noutput: {path: out}\n',
     r"model: contains a NUL character \(\\0\) at position 1"),
    ("NUL in input.path", b'model: m\ninput: {path: "da\\x00ta", prompt_column: p}\noutput: {path: out}\n',
     r"input.path: contains a NUL character"),
    ("NUL in output.path", b'model: m\ninput: {path: data, prompt_column: p}\noutput: {path: "o\\0"}\n',
     r"output.path: contains a NUL character"),
    ("NUL in a stop string", HEAD + b'sampling: {stop: [ok, "a\\0"]}\n', r"sampling.stop\[1\]: contains a NUL"),
    ("surrogate in a column name", b'model: m\ninput: {path: data, prompt_column: "p\\uDC80"}\noutput: {path: out}\n',
     r"input.prompt_column: contains a lone surrogate \(\\udc80\) at position 1, which is not a character"),
    ("surrogate in system_prompt",
     b'model: m\ninput: {path: data, prompt_column: p, system_prompt: "x\\uD800"}\noutput: {path: out}\n',
     r"input.system_prompt: contains a lone surrogate"),
    ("surrogate in an adapter name", HEAD + b'adapters: {"a\\uD800": x}\n',
     r"adapters.'a\\ud800': the key contains a lone surrogate"),
    ("surrogate in a nested response_format",
     HEAD + b'sampling: {response_format: {type: json_schema, schema: {enum: [a, "\\uD800"]}}}\n',
     r"sampling.response_format.schema.enum\[1\]: contains a lone surrogate"),
    ("surrogate in chat_template_kwargs",
     b'model: m\ninput: {path: data, prompt_column: p, chat_template_kwargs: {x: "\\uD800"}}\noutput: {path: out}\n',
     r"input.chat_template_kwargs.x: contains a lone surrogate"),
]


@pytest.mark.parametrize("name,data,needle", CASES, ids=[c[0] for c in CASES])
def test_invalid_text_is_a_config_error_naming_the_field(name, data, needle, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_bytes(data)
    with pytest.raises(ConfigError, match=needle):
        load_job(job)


def test_a_utf8_byte_order_mark_is_fine(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_bytes(b"\xef\xbb\xbf" + HEAD)
    assert load_job(job).input.prompt_column == "p"


def test_environment_value_of_non_utf8_bytes_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHRUN_TEST_DIR", "/tmp/d\udcff")  # the bytes /tmp/d\xff, as os.environ holds them
    job = tmp_path / "job.yaml"
    job.write_bytes(b"model: m\ninput: {path: $BATCHRUN_TEST_DIR/data, prompt_column: p}\noutput: {path: out}\n")
    with pytest.raises(ConfigError, match=r"input.path: '\$BATCHRUN_TEST_DIR/data' expands to a path that contains "
                                          r"a lone surrogate \(\\udcff\)"):
        load_job(job)


def test_cli_exits_with_the_config_code_not_a_traceback(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_bytes(CASES[0][1])
    for command in ("plan", "run"):
        r = run_cli(command, job)
        assert r.returncode == ExitCode.CONFIG, (r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and "not valid UTF-8 text" in r.stderr, r.stderr
