"""Train batchrun's demo assets: a tiny character-level Llama and two LoRA adapters.

The demo has to show that adapters matter, so the three behaviours are trivially checkable:

    base model          copies the prompt       "hello world" -> "hello world"
    adapter `reverse`   reverses it             "hello world" -> "dlrow olleh"
    adapter `upper`     upper-cases it          "hello world" -> "HELLO WORLD"

Prompt format (what the tokenizer does on its own, so a job's prompt text is the plain string):

    tokenizer("hello world")["input_ids"]  ==  <s> h e l l o ␠ w o r l d <sep>
    the model generates                        h e l l o ␠ w o r l d </s>   (greedy)
    tokenizer.decode(new_ids, skip_special_tokens=True) == "hello world"

The `<s>`/`<sep>` wrapping is the tokenizer's post-processor (TemplateProcessing), one token per
character. The demo prompt distribution is lowercase words (a-z) separated by single spaces,
3-16 characters long; other characters tokenize but were never trained.

Outputs (all safetensors, ~4 MB in all):
    demo/model/                  LlamaForCausalLM + tokenizer (save_pretrained)
    demo/adapters/{reverse,upper}/   PEFT LoRA adapters (save_pretrained)
    demo/data/prompts.parquet    a dozen demo rows (id, prompt, adapter)

Run from the repo root:  python scripts/train_demo.py   (CPU, a few minutes on 2 cores).
It prints exact-match rates of greedy generation on held-out prompts and exits non-zero if any
task is below 100 %.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import string
import sys
import time
import zlib
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

import transformers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<sep>"]  # ids 0..4, in this order
CHARS = " " + string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'-:;"
MIN_LEN, MAX_LEN = 3, 16  # demo prompt length in characters
TASKS = {
    "base": lambda s: s,
    "reverse": lambda s: s[::-1],
    "upper": lambda s: s.upper(),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # One token per character: isolate every character (spaces included) as its own piece.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # Fuse joins pieces with no separator (the default decoder would insert spaces).
    tok.decoder = decoders.Fuse()
    # A single prompt becomes exactly the model input; a pair (prompt, target) is a training row.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A <sep>",
        pair="<s> $A <sep> $B:1 </s>:1",
        special_tokens=[("<s>", vocab["<s>"]), ("<sep>", vocab["<sep>"]), ("</s>", vocab["</s>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<sep>"],
        # Cleanup would turn "a ." into "a." and break exact answers.
        clean_up_tokenization_spaces=False,
        model_max_length=128,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    tokenizer.save_pretrained(path)
    # transformers 5 writes its own class name and a list-valued extra_special_tokens; rewrite
    # them as the names every transformers >= 4.45 (pyproject's floor) loads the same way.
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- data


def random_prompt(rng: random.Random, mixed_case: bool = False) -> str:
    """Words separated by single spaces, MIN_LEN..MAX_LEN characters, no edge spaces.

    Demo prompts are lowercase. Training also draws mixed-case prompts (word-wise lower /
    Capitalised / UPPER / rAnDoM) so that the base learns to emit every letter: otherwise the
    unembedding rows of A-Z are never a target and `upper` could only reach them with small
    logit margins, which low-precision engines may flip.
    """
    n = rng.randint(MIN_LEN, MAX_LEN)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n + 1:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 7)))
        if mixed_case:
            style = rng.randrange(4)
            if style == 1:
                w = w.capitalize()
            elif style == 2:
                w = w.upper()
            elif style == 3:
                w = "".join(c.upper() if rng.random() < 0.5 else c for c in w)
        words.append(w)
    s = " ".join(words)[:n]
    if s.endswith(" "):  # cut fell on a space: end on a letter instead
        s = s[:-1] + rng.choice(string.ascii_lowercase)
    return s


def is_heldout(prompt: str) -> bool:
    # A fixed hash split: held-out prompts are never trained on, whatever the seed or step count.
    return zlib.crc32(prompt.encode()) % 10 == 0


def sample_prompts(rng: random.Random, n: int, heldout: bool, mixed_frac: float = 0.0) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        p = random_prompt(rng, mixed_case=rng.random() < mixed_frac)
        if is_heldout(p) == heldout:
            out.append(p)
    return out


def make_batch(tokenizer, prompts: list[str], task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids <s> prompt <sep> target </s> <pad>...; labels only on target + </s>."""
    targets = [TASKS[task](p) for p in prompts]
    enc = tokenizer(prompts, targets, padding=True, padding_side="right", return_tensors="pt")
    ids = enc["input_ids"]
    labels = ids.clone()
    for row, p in enumerate(prompts):
        labels[row, : len(p) + 2] = -100  # <s> prompt <sep>: conditioned on, not predicted
    labels[enc["attention_mask"] == 0] = -100
    return ids, labels


# --------------------------------------------------------------------------- training


def train(model, params, tokenizer, task: str, steps: int, lr: float, batch: int, seed: int, log: str):
    rng = random.Random(seed)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)),
    )
    model.train()
    t0, running = time.time(), 0.0
    for step in range(1, steps + 1):
        ids, labels = make_batch(tokenizer, sample_prompts(rng, batch, heldout=False, mixed_frac=0.5), task)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        if step % 100 == 0 or step == steps:
            k = 100 if step % 100 == 0 else step % 100
            print(f"[{log}] step {step}/{steps} loss {running / k:.4f} ({time.time() - t0:.0f}s)", flush=True)
            last, running = running / k, 0.0
    model.eval()
    return last


@torch.no_grad()
def exact_match(model, tokenizer, prompts: list[str], task: str) -> tuple[float, list[tuple[str, str]]]:
    """Greedy HF generate, max_new_tokens = len + 2; a hit is the exact string followed by </s>."""
    model.eval()
    by_len: dict[int, list[str]] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).append(p)
    misses: list[tuple[str, str]] = []
    for n, group in sorted(by_len.items()):
        # Same length -> same token count (one token per char): no padding needed.
        enc = tokenizer(group, return_tensors="pt")
        out = model.generate(
            **enc,
            max_new_tokens=n + 2,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for p, row in zip(group, out[:, enc["input_ids"].shape[1] :].tolist()):
            text = tokenizer.decode(row, skip_special_tokens=True)
            ended = tokenizer.eos_token_id in row
            if text != TASKS[task](p) or not ended:
                misses.append((p, text))
    return 1.0 - len(misses) / len(prompts), misses


# --------------------------------------------------------------------------- assets


def write_prompts_parquet(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    # The same texts under all three, so the difference adapters make is visible side by side.
    for text in ["hello world", "batch run", "lora adapters"]:
        for adapter in (None, "reverse", "upper"):
            rows.append((text, adapter))
    rows += [("good morning", None), ("the quick fox", "reverse"), ("abc def", "upper")]
    table = pa.table(
        {
            "id": pa.array([f"demo-{i:03d}" for i in range(len(rows))], pa.string()),
            "prompt": pa.array([r[0] for r in rows], pa.string()),
            "adapter": pa.array([r[1] for r in rows], pa.string()),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-steps", type=int, default=1000)
    ap.add_argument("--adapter-steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--base-lr", type=float, default=3e-3)
    ap.add_argument("--adapter-lr", type=float, default=3e-3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--eval-n", type=int, default=200, help="held-out prompts per task")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 is as fast for this tiny model and robust on a busy machine")
    ap.add_argument("--reuse-base", action="store_true",
                    help="skip base training: load OUT/model and train only the adapters")
    args = ap.parse_args()

    from peft import LoraConfig, PeftModel, get_peft_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t_start = time.time()

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).float()
    print(f"model: {sum(p.numel() for p in model.parameters()):,} params", flush=True)

    eval_rng = random.Random(12345)
    eval_sets = {  # "demo" (lowercase) must be 100 %; "mixed" (mixed case) is reported only
        "demo": sample_prompts(eval_rng, args.eval_n, heldout=True),
        "mixed": sample_prompts(eval_rng, args.eval_n, heldout=True, mixed_frac=1.0),
    }

    # 1) base model: copy.
    out = args.out
    final_loss = {"base": float("nan")}
    if args.reuse_base:
        model = LlamaForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    else:
        final_loss["base"] = train(model, list(model.parameters()), tokenizer, "base", args.base_steps, args.base_lr,
              args.batch, args.seed + 1, "base/copy")
        if (out / "model").exists():
            shutil.rmtree(out / "model")
        model.save_pretrained(out / "model", safe_serialization=True)
        save_tokenizer(tokenizer, out / "model")

    results: dict[tuple[str, str], float] = {}

    def evaluate(m, task: str) -> None:
        for name, prompts in eval_sets.items():
            rate, misses = exact_match(m, tokenizer, prompts, task)
            results[task, name] = rate
            print(f"{task} exact match on {name} prompts {rate:.1%}  misses {misses[:5]}", flush=True)

    evaluate(model, "base")

    # 2) adapters on the frozen base.
    for i, task in enumerate(["reverse", "upper"]):
        torch.manual_seed(args.seed + 10 + i)
        base = LlamaForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                          target_modules=LORA_TARGETS, bias="none", task_type="CAUSAL_LM")
        pm = get_peft_model(base, lora)
        params = [p for p in pm.parameters() if p.requires_grad]
        print(f"adapter {task}: {sum(p.numel() for p in params):,} trainable params", flush=True)
        final_loss[task] = train(pm, params, tokenizer, task, args.adapter_steps, args.adapter_lr, args.batch,
              args.seed + 20 + i, task)
        dest = out / "adapters" / task
        if dest.exists():
            shutil.rmtree(dest)
        pm.save_pretrained(dest, safe_serialization=True)
        (dest / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template
        # save_pretrained records this machine's absolute path; record the repo-relative one.
        cfg_path = dest / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = "demo/model"
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        # Evaluate what was saved, loaded the way a user would.
        pm = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(out / "model", dtype=torch.float32), dest
        )
        evaluate(pm, task)

    write_prompts_parquet(out / "data" / "prompts.parquet")
    elapsed = time.time() - t_start
    print("\n=== demo assets ===")
    print(f"training+eval time {elapsed:.0f}s (torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {args.threads} threads)")
    for (task, name), rate in results.items():
        print(f"exact match  {task:8s} {name:6s} {rate:7.1%}  on {len(eval_sets[name])} held-out prompts"
              f"  (final train loss {final_loss[task]:.4f})")
    print(f"size of {out}: {dir_size(out) / 1e6:.2f} MB")
    return 0 if all(r == 1.0 for (_, name), r in results.items() if name == "demo") else 1


if __name__ == "__main__":
    sys.exit(main())
