"""The PDL branch of every Triton kernel, compiled for an sm_90 GPU on a CPU machine.

The interpreter (CPU) runs each kernel with PDL=False, so the code behind `if PDL:` (the
griddepcontrol calls, the L2 prefetch) is never traced there: a mistake in it (a global the
JIT cannot read, a wrong argument) would only show on a GPU. tests/kernels/conftest.py records
every interpreted launch of a kernel that takes a `PDL` constexpr and hands it here, which
lowers the same kernel with the same argument types and constexprs, PDL=True, to Triton IR for
sm_90 (the frontend: no GPU, no ptxas). One lowering per kernel and combination of its bool /
None constexprs (the branches), so the suite pays a few seconds, not one per launch.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import types

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
          torch.int64: "i64", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
_done: set = set()
_jitted: dict = {}


def _jit(fn):
    """A JITFunction of `fn` whose globals hold JITFunctions where the interpreter put its
    InterpretedFunctions (the helpers a kernel calls, like pdl_enter), recursively."""
    if fn in _jitted:
        return _jitted[fn]
    from triton.runtime.interpreter import InterpretedFunction
    globs = dict(fn.__globals__)
    copy = types.FunctionType(fn.__code__, globs, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__module__, copy.__qualname__ = fn.__module__, fn.__qualname__
    copy.__annotations__, copy.__kwdefaults__ = fn.__annotations__, fn.__kwdefaults__
    jit = _jitted[fn] = triton.runtime.jit.JITFunction(copy)
    for name, value in fn.__globals__.items():
        if isinstance(value, InterpretedFunction):
            globs[name] = _jit(value.fn)
    return jit


def _arg_type(name: str, value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument {name}={value!r}: no Triton type for {type(value).__name__}")


def _language_modules():
    # triton.language and its submodules, as imported now
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("triton.language"):
            yield name, module


def _language_parts():
    # the modules of triton.language and the classes they define: what the interpreter patches
    for name, module in _language_modules():
        yield module
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                yield value


# taken when the conftest imports this module, before any interpreted launch
_PRISTINE = [(part, dict(vars(part))) for part in _language_parts()]


@contextlib.contextmanager
def _unpatched_language():
    """The interpreter patches triton.language at each launch and (triton 3.9) does not undo
    all of it: put the attributes seen before the first launch back while lowering."""
    undo = []
    for part, attrs in _PRISTINE:
        now = dict(vars(part))
        for attr, value in attrs.items():
            if now.get(attr, _PRISTINE) is not value:
                undo.append((part, attr, now.get(attr, _PRISTINE)))
                setattr(part, attr, value)
        for attr in now.keys() - attrs.keys():
            undo.append((part, attr, now[attr]))
            delattr(part, attr)
    try:
        yield
    finally:
        for part, attr, value in reversed(undo):
            if value is _PRISTINE:
                delattr(part, attr)
            else:
                setattr(part, attr, value)


@contextlib.contextmanager
def _compiled_language():
    """Under TRITON_INTERPRET=1 `triton.jit` made Triton's own library functions (tl.sum,
    tl.max, ...) InterpretedFunctions too: put JITFunctions in their place while lowering."""
    from triton.runtime.interpreter import InterpretedFunction
    swapped = []
    for _, module in _language_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, InterpretedFunction):
                swapped.append((module, attr, value))
                setattr(module, attr, _jit(value.fn))
    try:
        yield
    finally:
        for module, attr, value in swapped:
            setattr(module, attr, value)


def lower_with_pdl(fn, args: tuple, kwargs: dict) -> bool:
    """Lower `fn` (the kernel's Python function) called with `args` / `kwargs` to Triton IR for
    sm_90 with PDL=True. False when this kernel and branch combination was lowered before."""
    jit = _jit(fn)
    names = [p.name for p in jit.params]
    bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    values = dict(bound.arguments)
    values["PDL"] = True
    constexpr = {p.name for p in jit.params if p.is_constexpr}
    signature, constexprs = {}, {}
    for name, value in values.items():
        if name in constexpr or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value
        else:
            signature[name] = _arg_type(name, value)
    key = (fn.__module__, fn.__qualname__,
           tuple((k, v) for k, v in constexprs.items() if v is None or isinstance(v, bool)))
    if key in _done:
        return False
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    from triton._C.libtriton import ir
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    options = backend.parse_options({})
    src = ASTSource(fn=jit, signature=signature, constexprs=constexprs)
    with _unpatched_language(), _compiled_language():
        src.make_ir(target, options, backend.get_codegen_implementation(options),
                    backend.get_module_map(), context)
    _done.add(key)
    return True
