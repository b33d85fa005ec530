"""When may `lora-matrix` compare a scenario with its baseline?

Only when both ran with the same KV cache (number of blocks) and the same scheduling cost:
the same preemptions and recomputed tokens over their timed iterations. A LoRA engine that
runs short of blocks and preempts pays for recomputation, not for LoRA, and a ratio built on
that says nothing about LoRA. Such a scenario is flagged "not comparable" with the reasons,
and its target verdict is withheld (met = None).
"""
from __future__ import annotations


def comparability(scenario: dict, baseline: dict, kv_blocks: dict[str, int]) -> dict:
    """scenario/baseline: summaries with "engine" ("A"/"B"), "preemptions" and
    "recomputed_tokens" (totals over the timed iterations). kv_blocks: engine -> blocks."""
    reasons = []
    ka, kb = kv_blocks.get(baseline["engine"]), kv_blocks.get(scenario["engine"])
    if ka is None or kb is None or ka != kb:
        reasons.append(f"KV blocks differ: {kb} (engine {scenario['engine']}) vs {ka} "
                       f"(engine {baseline['engine']})")
    for key in ("preemptions", "recomputed_tokens"):
        s, b = scenario.get(key), baseline.get(key)
        if s is None or b is None or s != b:
            reasons.append(f"{key.replace('_', ' ')} differ: {s} vs {b} in the baseline")
    return {"comparable": not reasons, "not_comparable_reasons": reasons}


def apply(scenarios: dict, kv_blocks: dict[str, int]) -> None:
    """Mark every non-baseline scenario of a summaries dict in place."""
    for name, s in scenarios.items():
        base = scenarios.get(s["baseline"])
        if base is None or name == s["baseline"]:
            continue
        s.update(comparability(s, base, kv_blocks))
