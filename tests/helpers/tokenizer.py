"""Character-level tokenizers built in memory: one token per character, so tests can predict
token counts and exact strings."""
from __future__ import annotations

import string

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<sep>"]
CHARS = " " + string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'-:;"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def char_tokenizer(chars: str = CHARS, specials: list[str] = SPECIALS, wrap: bool = True,
                   chat_template: str | None = CHAT_TEMPLATE):
    """A fast tokenizer over ``specials + chars`` (ids in that order). ``wrap``: encoding adds
    ``<s> ... <sep>`` (needs ``<sep>`` among the specials)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(list(specials) + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    named = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    if wrap:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A <sep>", special_tokens=[("<s>", vocab["<s>"]), ("<sep>", vocab["<sep>"])])
        named["sep_token"] = "<sep>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def build_tokenizer():
    """The runner tests' tokenizer: CHARS, wrapped in <s> ... <sep>, with a chat template."""
    return char_tokenizer()
