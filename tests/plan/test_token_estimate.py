"""`plan --estimate-tokens` (token_estimate.py): the byte bound that keeps error rows exact holds
for every pipeline kind it accepts, refuses the ones it cannot prove, and the estimated plan has
the exact plan's error rows and close totals."""
import random

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors

from batchrun.job.inputs import token_estimate
from batchrun.job.jobfile.spec import load_job
from batchrun.job.report import plan_report
from batchrun.job.inputs.token_estimate import byte_bound
from tests.helpers.jobs import demo_rows, REPO

SPECIALS = ["<unk>", "<s>", "</s>"]
ALPHABET = list("abcdefghij ABC") + ["  ", "\t", "\n", "é", "e\u0301", "\u0344", "한", "中文", "✓", "🙂", "\ufdfa",
                                     "\u2126", "İ", "<s>", "</s>", "▁", "\u3000", "ﬁ"]


def _texts(n=400, seed=0):
    rnd = random.Random(seed)
    return ["".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(1, 40))) for _ in range(n)]


def _finish(tok: Tokenizer) -> Tokenizer:
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok


def _byte_level_bpe():
    from tokenizers import trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.train_from_iterator(_texts(200, seed=1), trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.normalizer = normalizers.NFC()
    return _finish(tok)


def _llama2_style(byte_fallback=True):
    """SentencePiece-BPE as transformers converts Llama-2: Prepend + Replace, byte fallback."""
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + list("abcdefghij▁") + ["▁a"])}
    tok = Tokenizer(models.BPE(vocab, [("▁", "a")], unk_token="<unk>", byte_fallback=byte_fallback))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return _finish(tok)


def _metaspace_unigram():
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)] + \
            [(c, -2.0) for c in "abcdefghij▁"] + [("▁a", -1.0)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    return _finish(tok)


def _nfkc_wordpiece():
    vocab = {t: i for i, t in enumerate(SPECIALS + list("abcdefghij") + ["##" + c for c in "abcdefghij"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    return _finish(tok)


def _char_level():
    vocab = {t: i for i, t in enumerate(SPECIALS + list("abcdefghij ABC"))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return _finish(tok)


@pytest.mark.parametrize("make", [_byte_level_bpe, _llama2_style, lambda: _llama2_style(False), _metaspace_unigram,
                                  _nfkc_wordpiece, _char_level],
                         ids=["bytelevel-nfc", "llama2", "llama2-nofallback", "metaspace-unigram", "nfkc-wordpiece",
                              "char"])
def test_the_bound_holds_for_every_accepted_pipeline(make):
    tok = make()
    bound = byte_bound(tok)
    assert bound is not None
    f, a = bound
    specials = tok.num_special_tokens_to_add(False)
    texts = _texts() + ["\ufdfa" * 5, "\u0344" * 9, "<s>" * 7, "a<s>b</s>c", " " * 30, "▁" * 10]
    for text in texts:
        n = len(tok.encode(text, add_special_tokens=True))
        assert n <= f * len(text.encode()) + a + specials, (text, n, bound)


def test_the_demo_tokenizer_has_the_tight_bound():
    tok = Tokenizer.from_file(str(REPO / "demo" / "model" / "tokenizer.json"))
    assert byte_bound(tok) == (1.0, 0.0)


def test_pipelines_without_a_proof_get_no_bound():
    tok = _char_level()
    tok.normalizer = normalizers.Lowercase()
    assert byte_bound(tok) is None
    tok.normalizer = normalizers.BertNormalizer()
    assert byte_bound(tok) is None
    tok.normalizer = normalizers.Replace(Regex("a+"), "bb")
    assert byte_bound(tok) is None


def _rows(plan_text):
    """The shard table's rows: shard, rows, prompt tokens, units, error rows."""
    return {ln.split()[0]: ln.split() for ln in plan_text.splitlines()
            if ln.split()[:1] in (["base"], ["reverse"], ["upper"]) and len(ln.split()) == 5 and ln.split()[1].isdigit()}


def test_estimated_plan_has_exact_error_rows_and_close_totals(make_job, monkeypatch):
    rows = demo_rows(60)
    for i in (3, 10, 31, 44):
        rows[i]["prompt"] = "b" * (100 + i)  # too long with max_tokens 24 in max_model_len 128
    rows[5]["prompt"] = "   "
    rows[7]["prompt"] = None
    spec = load_job(make_job(rows))
    exact = _rows(plan_report(spec, 1))
    monkeypatch.setattr(token_estimate, "ESTIMATE_SAMPLE_ROWS", 6)  # stride 10: most rows estimated
    text = plan_report(spec, 1, estimate_tokens=True)
    est = _rows(text)
    assert "~ estimated" in text and "error rows are exact" in text
    for shard in exact:
        assert est[shard][4] == exact[shard][4], (shard, text)  # error rows
        assert est[shard][2].startswith("~")
        want, got = int(exact[shard][2]), int(est[shard][2][1:])
        assert abs(got - want) <= 0.15 * want, (shard, got, want)


def test_estimate_is_exact_and_says_so_when_the_prompts_need_the_chat_template(make_job):
    spec = load_job(make_job(demo_rows(12), input={"system_prompt": "be brief"}))
    text = plan_report(spec, 1, estimate_tokens=True)
    assert "~" not in text and "prompt tokens exact" in text
    assert _rows(text) == _rows(plan_report(spec, 1))


def test_estimate_with_token_id_prompts_counts_them_exactly(make_job):
    rows = [{"id": i, "ids": [1, 5 + i % 7, 6] * (1 + i % 3), "adapter": None} for i in range(10)]
    spec = load_job(make_job(rows, input={"prompt_column": None, "prompt_token_ids_column": "ids"}))
    text = plan_report(spec, 1, estimate_tokens=True)
    assert "~" not in text
    assert _rows(text) == _rows(plan_report(spec, 1))
