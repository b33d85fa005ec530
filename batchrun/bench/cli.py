"""`batchrun bench ...`: the `bench` click group, registered by batchrun/cli.py.

Failures print one "batchrun: error:" line and exit 3 for bad configuration (model, adapters)
or 2 for bad flags, like the rest of the CLI.
"""
from __future__ import annotations

import shlex
import sys

import click

from batchrun.bench.presets import PRESET_MODELS
from batchrun.engine.config import DEVICES, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, removed_key_message
from batchrun.errors import ConfigError

_USAGE, _CONFIG = 2, 3


def _fail(code: int, message: str):
    click.echo(f"batchrun: error: {message}", err=True)
    sys.exit(code)


def _command_line() -> str:
    """The running bench command with every option spelled out (defaults resolved), so a
    result file says exactly what ran."""
    ctx = click.get_current_context()
    words = ["batchrun", "bench", ctx.info_name]
    for param in ctx.command.params:
        if not isinstance(param, click.Option):
            continue
        value, flag = ctx.params.get(param.name), param.opts[0]
        if param.is_flag:
            if value:
                words.append(flag)
        elif value is not None:
            words += [flag, str(value)]
    return shlex.join(words)


def _echo(msg: str) -> None:
    click.echo(msg)
    sys.stdout.flush()


def _removed(decl: str, key: str, **kw):
    """A flag that set an engine experiment switch (engine.<key>), kept hidden so that a command
    line that still gives it fails with the BATCHRUN_* variable that replaced it."""
    def refuse(ctx, param, value):
        if value is not None:
            flag = decl.split("/")[0 if value is not False else 1]
            _fail(_USAGE, f"{flag}: {removed_key_message(key, value)}")
    return click.option(decl, key, default=None, hidden=True, expose_value=False,
                        callback=refuse, **kw)


@click.group()
def bench():
    """Benchmarks on the engine (a preset --model builds random weights of that shape).

    The engine's experiment switches come from BATCHRUN_* environment variables
    (batchrun/engine/envs.py), as in every run, and each result records them."""


def _quant_options():
    """engine.quantization and engine.kv_cache_dtype as flags (vllm's names)."""
    return [click.option("--quantization", type=click.Choice(QUANTIZATIONS), default=None,
                         help="fp8: FP8 linear layers, quantized at load time (per-channel "
                              "weights, per-token activations)."),
            click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto",
                         show_default=True, help="fp8: an e4m3 KV cache.")]


def _quant_flags(f):
    for o in reversed(_quant_options()):
        f = o(f)
    return f


def _common(f):
    """Flags shared by latency and lora-matrix (vllm bench latency names and defaults)."""
    opts = [
        click.option("--model", default="llama-2-7b", show_default=True,
                     help="Local Hugging Face model directory, or a preset ("
                          + ", ".join(n for n in dict.fromkeys(PRESET_MODELS.values()) if n != "tiny")
                          + ", tiny) that builds RANDOM bf16 weights of that shape."),
        click.option("--batch-size", type=int, default=8, show_default=True),
        click.option("--input-len", type=int, default=32, show_default=True,
                     help="Prompt tokens per request (random ids in [100, vocab))."),
        click.option("--output-len", type=int, default=128, show_default=True,
                     help="Generated tokens per request (fixed: EOS is ignored)."),
        click.option("--dtype", type=click.Choice(DTYPES),
                     default="auto", show_default=True,
                     help="auto = the config's torch_dtype on GPU, float32 on CPU."),
        click.option("--device", type=click.Choice(DEVICES), default="auto",
                     show_default=True),
        *_quant_options(),
        click.option("--max-lora-rank", type=int, default=16, show_default=True),
        click.option("--lora-rank", type=int, default=16, show_default=True,
                     help="Rank of the random adapters (all 7 projections: q,k,v,o,gate,up,down)."),
        click.option("--enforce-eager", is_flag=True, help="No CUDA graphs."),
        _removed("--async-scheduling/--no-async-scheduling", "async_scheduling"),
        _removed("--triton-decode-gemm/--no-triton-decode-gemm", "triton_decode_gemm"),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--max-num-seqs", type=int, default=None,
                     help="Engine max_num_seqs (also the largest CUDA-graph size). "
                          "Default: max(64, batch size)."),
        click.option("--max-num-batched-tokens", type=int, default=2048, show_default=True),
        _removed("--lora-fused-max-tokens", "lora_fused_max_tokens", type=int),
        click.option("--output-json", type=click.Path(dir_okay=False), default=None,
                     help="Write the results (command, commit, device, all numbers) here."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@bench.command()
@_common
@click.option("--num-iters-warmup", type=int, default=10, show_default=True)
@click.option("--num-iters", type=int, default=30, show_default=True)
@click.option("--enable-lora", is_flag=True, help="Engine with LoRA (random adapters are loaded).")
@click.option("--max-loras", type=int, default=None,
              help="GPU adapter slots; that many random adapters are loaded. "
                   "Default: max(--num-active-loras, 1).")
@click.option("--num-active-loras", type=int, default=0, show_default=True,
              help="Adapters the batch uses, round-robin over rows; 0 = LoRA enabled but no row "
                   "has an adapter.")
def latency(**kw):
    """Latency of one batch end to end (like `vllm bench latency`)."""
    from batchrun.bench.latency import LatencyParams, print_latency, run_latency
    _run(LatencyParams(**kw), run_latency, print_latency)


@bench.command("lora-matrix")
@_common
@click.option("--num-iters-warmup", type=int, default=3, show_default=True,
              help="Warm-up rounds (one iteration of every scenario each).")
@click.option("--num-iters", type=int, default=15, show_default=True,
              help="Timed rounds for the CUDA-graph scenarios.")
@click.option("--num-iters-eager", type=int, default=None,
              help="Timed rounds for the eager scenarios (default: --num-iters); they run in "
                   "the first rounds, interleaved with the graph scenarios.")
@click.option("--max-loras", type=int, default=8, show_default=True,
              help="GPU slots of the LoRA engine; that many adapters are loaded, and the "
                   "many-adapter scenario uses all of them.")
@click.option("--no-eager", is_flag=True, help="Skip the eager comparison scenarios.")
@click.option("--profile-kernels", is_flag=True,
              help="Check with torch.profiler that one no-adapter decode step of the LoRA engine "
                   "launches exactly the kernels of the LoRA-disabled engine.")
@click.option("--preset", type=click.Choice(["latency", "throughput"]), default=None,
              help="Workload: latency = batch 8, in 32, out 128 (the defaults); throughput = "
                   "batch 256, in 256, out 128, --max-num-seqs 256, --max-num-batched-tokens "
                   "8192, --target-many-active-pct 10. Flags given explicitly win over the preset.")
@click.option("--num-kv-blocks", type=int, default=None,
              help="KV blocks of BOTH engines (BATCHRUN_NUM_KV_BLOCKS is ignored here). Default: "
                   "engine A sized from free memory, engine B forced to A's count.")
@click.option("--target-0-active-pct", type=float, default=0.5, show_default=True,
              help="Budget: % slower than LoRA disabled with LoRA enabled and no active adapter.")
@click.option("--target-1-active-pct", type=float, default=8.0, show_default=True,
              help="Budget: % slower than LoRA disabled with every row on one adapter.")
@click.option("--target-many-active-pct", type=float, default=15.0, show_default=True,
              help="Budget: % slower than LoRA disabled with rows over --max-loras adapters.")
@click.option("--target-memory-ratio", type=float, default=1.15, show_default=True,
              help="Budget: the LoRA engine's graph pools (all sets) over the no-LoRA set's.")
@click.option("--target-capture-s", type=float, default=20.0, show_default=True,
              help="Budget: seconds to capture all graph sets of the LoRA engine.")
def lora_matrix(**kw):
    """LoRA disabled vs enabled with 0 / 1 / max-loras active adapters, graphs and eager,
    A/B interleaved in one process, with each slowdown against its --target-* budget."""
    from batchrun.bench.matrix import MatrixParams, apply_preset, run_matrix
    from batchrun.bench.matrix_report import print_matrix
    ctx = click.get_current_context()
    explicit = {k for k in kw
                if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT}
    try:
        kw = apply_preset(kw, explicit)
    except ValueError as e:
        _fail(_USAGE, str(e))
    ctx.params.update(kw)  # the recorded command line shows the preset's values
    _run(MatrixParams(**kw), run_matrix, print_matrix)


@bench.command()
@click.option("--preset", type=click.Choice(list(PRESET_MODELS)), default="7b", show_default=True,
              help="Model shape of the RANDOM weights written as a model directory "
                   "(7b = Llama-2-7b, bf16; tiny = a CPU test model; or a model preset).")
@click.option("--input-len", type=int, default=256, show_default=True,
              help="Prompt length: words of the word-level tokenizer, one token each.")
@click.option("--prefix-len", type=int, default=0, show_default=True,
              help="Tokens every prompt starts with (a shared system prompt), before its own "
                   "--input-len.")
@click.option("--output-len", type=int, default=128, show_default=True,
              help="Generated tokens per row (the random model has no EOS token).")
@click.option("--num-prompts", type=int, default=1024, show_default=True)
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=8192, show_default=True)
@click.option("--lora-fraction", type=float, default=0.5, show_default=True,
              help="Share of the rows that name an adapter (round-robin over the adapters).")
@click.option("--num-adapters", type=int, default=4, show_default=True)
@click.option("--lora-rank", type=int, default=16, show_default=True,
              help="Rank of the random adapters (all 7 projections).")
@click.option("--max-loras", type=int, default=None,
              help="Job engine.max_loras. Default: --num-adapters.")
@click.option("--rows-per-unit", type=int, default=1024, show_default=True,
              help="Job input.rows_per_unit.")
@click.option("--engine-warmup-rows", type=int, default=32, show_default=True,
              help="Engine alone: an untimed generate of this many rows (4 tokens each) first, "
                   "so the timed call finds its kernels compiled; 0 = time a cold first call.")
@click.option("--device", type=click.Choice(DEVICES), default="auto",
              show_default=True)
@_quant_flags
@click.option("--dtype", type=click.Choice(DTYPES),
              default="auto", show_default=True)
@click.option("--gpu-memory-utilization", type=float, default=0.90, show_default=True)
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
              help="Job engine.enable_prefix_caching (both runs).")
@_removed("--enable-mixed-steps/--no-enable-mixed-steps", "enable_mixed_steps")
@_removed("--async-scheduling/--no-async-scheduling", "async_scheduling")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Keep the model, adapters, inputs and job output here (a model written "
                   "earlier with the same preset and seed is reused). Default: a temporary "
                   "directory, removed afterwards.")
@click.option("--output-json", "--out", "output_json", type=click.Path(dir_okay=False),
              default=None, help="Write the full results (git sha, env, args, timings) here.")
def throughput(**kw):
    """Engine alone vs `batchrun run` on the same rows (like `vllm bench throughput`), with the
    job's start-up breakdown and the job/engine ratio."""
    from batchrun.bench.throughput import ThroughputParams, run_throughput
    from batchrun.bench.throughput_report import print_throughput
    _run(ThroughputParams(**kw), run_throughput, print_throughput)


def _run(params, run, show) -> None:
    """Check the parameters (usage error), run (config error), print, say where JSON went."""
    try:
        params.check()
    except ValueError as e:
        _fail(_USAGE, str(e))
    except ConfigError as e:  # a bad BATCHRUN_* experiment variable (engine/envs.py)
        _fail(_CONFIG, str(e))
    try:
        result = run(params, log=_echo, command=_command_line())
    except ConfigError as e:
        _fail(_CONFIG, str(e))
    show(result, echo=_echo)
    if params.output_json:
        _echo(f"results written to {params.output_json}")
