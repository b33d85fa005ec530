"""The files `bench throughput` runs on: a real model directory with RANDOM weights, a word-level
tokenizer, random PEFT adapters, Parquet inputs and a job.yaml.

- Weights: every tensor `models/checkpoint.expected_shapes` lists, made on the device in the
  preset's dtype (matrices ~ N(0, 0.02) in place, norms 1), written as safetensors shards with a
  model.safetensors.index.json, so `batchrun run` loads them through its normal loader.
- config.json has no eos_token_id and the tokenizer no EOS token: greedy rows never stop early,
  every row generates exactly --output-len tokens (what vLLM's --ignore-eos does).
- Tokenizer: `tokenizers` WordLevel over the words "w0".."w{V-1}" (id i = word "w{i}"), split on
  whitespace, no post-processor (no BOS), so a prompt of N words is exactly N tokens.
- Inputs: --num-prompts rows (id, prompt of --input-len words with ids in [100, V), adapter);
  round(lora_fraction * N) rows, picked by the seed, get an adapter, round-robin over the adapters.
  --prefix-len P > 0: every prompt starts with the same P words (a shared system prompt, the
  prefix cache's case), then its own --input-len words.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from batchrun.bench.adapters import write_random_adapters
from batchrun.bench.presets import PRESETS
from batchrun.engine.models.checkpoint import expected_shapes
from batchrun.engine.models.config import ModelConfig

SHARD_BYTES = 2 << 30  # safetensors shard size (about); smaller shards keep host memory low
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def workload_config(preset: str) -> dict:
    """config.json contents: the preset's shape without an EOS token (see the module doc)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (presets: {', '.join(PRESETS)})")
    cfg = dict(PRESETS[preset])
    cfg.pop("eos_token_id", None)
    return cfg


@torch.no_grad()
def write_random_model(path: Path, preset: str, device: torch.device, seed: int = 0) -> dict:
    """A model directory of random weights; returns {"bytes", "files", "seconds"...} facts."""
    import time
    from safetensors.torch import save_file
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    raw = workload_config(preset)
    cfg = ModelConfig.from_dict(dict(raw), where=f"preset {preset}")
    dtype = _DTYPES[raw["torch_dtype"]]
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total = 0, 0
    for name, shape in expected_shapes(cfg).items():
        t = torch.empty(shape, device=device, dtype=dtype)
        if len(shape) == 1:  # norms scaling by 1 (weight 1, or 0 for Gemma's 1 + w); biases 0
            t.fill_(1.0 - cfg.norm_offset if name.endswith("norm.weight") else 0.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    weight_map, files = {}, []
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / fname),
                  metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in tensors})
        tensors.clear()  # free this shard's device memory before the next
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_word_tokenizer(path, cfg.vocab_size, max_len=cfg.max_position_embeddings)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": total, "files": files, "dtype": raw["torch_dtype"], "write_s":
            time.perf_counter() - t0}


def word(i: int) -> str:
    return f"w{i}"


def write_word_tokenizer(path: Path, vocab_size: int, max_len: int) -> None:
    """tokenizer.json + tokenizer_config.json that AutoTokenizer loads: word "w{i}" is id i."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {word(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": word(0),
         "model_max_length": max_len, "clean_up_tokenization_spaces": False}, indent=2) + "\n")


@dataclass
class Inputs:
    ids: list[int]
    prompts: list[str]
    adapters: list[str | None]

    @property
    def num_lora_rows(self) -> int:
        return sum(a is not None for a in self.adapters)


def make_inputs(num_prompts: int, input_len: int, vocab_size: int, adapter_names: list[str],
                lora_fraction: float, seed: int, prefix_len: int = 0) -> Inputs:
    if vocab_size <= 100:
        raise ValueError(f"vocabulary of {vocab_size} is too small for prompt ids in [100, vocab)")
    rng = random.Random(seed)
    # its own generator: the rows' own words are the same with and without a prefix
    prefix_rng = random.Random(f"prefix:{seed}")
    prefix = "".join(word(prefix_rng.randrange(100, vocab_size)) + " " for _ in range(prefix_len))
    prompts = [prefix + " ".join(word(rng.randrange(100, vocab_size)) for _ in range(input_len))
               for _ in range(num_prompts)]
    k = round(lora_fraction * num_prompts) if adapter_names else 0
    lora_rows = sorted(rng.sample(range(num_prompts), k))
    adapters: list[str | None] = [None] * num_prompts
    for j, row in enumerate(lora_rows):
        adapters[row] = adapter_names[j % len(adapter_names)]
    return Inputs(list(range(num_prompts)), prompts, adapters)


def write_inputs(path: Path, inputs: Inputs, num_files: int = 1) -> list[Path]:
    """Parquet files id (int64), prompt (string), adapter (string, null = base)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    path.mkdir(parents=True, exist_ok=True)
    n = len(inputs.ids)
    out = []
    per = -(-n // num_files)
    for f in range(num_files):
        lo, hi = f * per, min(n, (f + 1) * per)
        table = pa.table({"id": pa.array(inputs.ids[lo:hi], pa.int64()),
                          "prompt": pa.array(inputs.prompts[lo:hi], pa.string()),
                          "adapter": pa.array(inputs.adapters[lo:hi], pa.string())})
        p = path / f"part-{f:03d}.parquet"
        pq.write_table(table, p)
        out.append(p)
    return out


def write_job(path: Path, *, model: Path, adapters: dict[str, str], inputs: Path, output: Path,
              output_len: int, engine: dict, rows_per_unit: int) -> Path:
    """job.yaml for `batchrun run` (greedy, max_tokens = output_len)."""
    import yaml
    job = {"model": str(model),
           "input": {"path": str(inputs), "id_column": "id", "prompt_column": "prompt",
                     "adapter_column": "adapter", "rows_per_unit": rows_per_unit},
           "output": {"path": str(output)},
           "sampling": {"max_tokens": output_len, "temperature": 0.0},
           "engine": engine, "on_error": "fail"}
    if adapters:
        job["adapters"] = dict(adapters)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def write_workload_adapters(root: Path, preset: str, count: int, rank: int, seed: int) -> dict[str, str]:
    cfg = ModelConfig.from_dict(workload_config(preset), where=f"preset {preset}")
    return write_random_adapters(root, cfg, count, rank, seed=seed, base_model=f"random {preset}")
