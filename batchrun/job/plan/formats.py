"""`batchrun plan`: which per-row response_format values would be error rows at run time.

At run time a row whose response_format does not compile (a valid-looking mapping whose schema
or regex xgrammar refuses) becomes an error row through the engine's check_request
(engine.Engine._format_problem). plan compiles each distinct per-row format once with the same
compiler, so it predicts those rows too. Only jobs with a response_format override column get
here; validate() has already imported xgrammar and torch for them (prepare.check_structured).
"""
from __future__ import annotations

from typing import Callable


def format_checker(spec, model_config) -> Callable[[str], bool]:
    """fmt (canonical JSON) -> whether it compiles for this model's tokenizer; cached per format."""
    from batchrun.engine.grammar import Grammars
    from batchrun.common.tokenizer import load_tokenizer
    tok = load_tokenizer(spec.model)
    if tok is None:  # the run refuses every response_format row: "needs a tokenizer"
        return lambda fmt: False
    eos = set(model_config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    grammars = Grammars(tok, model_config.vocab_size, eos)
    seen: dict[str, bool] = {}

    def compiles(fmt: str) -> bool:
        if fmt not in seen:
            try:
                grammars.compile(fmt)
                seen[fmt] = True
            except ValueError:
                seen[fmt] = False
        return seen[fmt]
    return compiles
