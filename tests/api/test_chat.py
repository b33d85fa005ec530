"""LLM.chat: one conversation or a list, rendered by the model's chat template as a job renders
a messages_column row; RequestOutput.prompt is that rendering."""
import pytest

from batchrun.errors import ConfigError

CONV = [{"role": "user", "content": "hello"}]


def test_chat_renders_the_template_and_echoes(char_llm):
    tok = char_llm.tokenizer
    want_ids = tok.apply_chat_template(CONV, add_generation_prompt=True, tokenize=True)
    want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
    one = char_llm.chat(CONV, {"max_tokens": 5}, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt == "hello" and one[0].prompt_token_ids == want_ids  # no BOS: auto
    many = char_llm.chat([CONV, [{"role": "user", "content": "abc"}]], {"max_tokens": 5}, use_tqdm=False)
    assert [o.prompt for o in many] == ["hello", "abc"] and [o.request_id for o in many] == [0, 1]
    assert many[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    same = char_llm.generate([CONV], {"max_tokens": 5}, use_tqdm=False)  # a message list given to generate
    assert same[0].outputs[0].token_ids == one[0].outputs[0].token_ids and same[0].prompt == "hello"


def test_chat_template_kwargs_reach_the_template(tmp_path, char_model):
    import json
    import shutil

    import batchrun
    d = tmp_path / "kw"
    shutil.copytree(char_model, d)
    for f in d.glob("chat_template.*"):
        f.unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = batchrun.LLM(d, device="cpu", max_model_len=128)
    assert llm.chat(CONV, use_tqdm=False, chat_template_kwargs={"shout": True})[0].prompt == "hello!!"
    assert llm.chat(CONV, use_tqdm=False)[0].prompt == "hello"


@pytest.mark.parametrize("call, needle", [
    (lambda llm: llm.chat([]), "messages: expected a conversation"),
    (lambda llm: llm.chat([CONV, "hi"]), r"messages\[1\]: a conversation must be a non-empty list"),
    (lambda llm: llm.chat([{"role": "user", "content": [{"type": "text", "text": "x"}]}]),
     r"messages\[0\]: message 0 content must be a string, got list"),
    (lambda llm: llm.chat([{"role": "user"}]), r"messages\[0\]: message 0 must be a dict with role and content"),
    (lambda llm: llm.chat(CONV, add_generation_prompt=False), "add_generation_prompt=False is not supported"),
    (lambda llm: llm.chat(CONV, continue_final_message=True), "continue_final_message=True is not supported"),
    (lambda llm: llm.chat(CONV, chat_template="{{ x }}"), "chat_template='{{ x }}' is not supported"),
    (lambda llm: llm.chat(CONV, tools=[{"type": "function"}]), "tools=.* is not supported"),
    (lambda llm: llm.chat(CONV, chat_template_content_format="openai"),
     "chat_template_content_format='openai' is not supported"),
])
def test_chat_mistakes_are_clear(char_llm, call, needle):
    with pytest.raises(ConfigError, match=needle):
        call(char_llm)


def test_an_empty_message_is_an_error_output_as_in_a_job(char_llm):
    out = char_llm.chat([[{"role": "user", "content": ""}], CONV], {"max_tokens": 3}, use_tqdm=False)
    assert out[0].error == "empty prompt (no tokens)" and out[0].outputs[0].finish_reason == "error"
    assert out[0].prompt_token_ids is None and out[0].outputs[0].text is None
    assert out[1].error is None and out[1].outputs[0].finish_reason == "length"


def test_a_model_without_a_chat_template_is_refused(demo_llm):
    with pytest.raises(ConfigError, match=r"prompts\[0\]: the tokenizer in .* has no chat template"):
        demo_llm.chat(CONV, use_tqdm=False)
