"""Every interpreted launch of a kernel with a `PDL` constexpr is also lowered for sm_90 with
PDL=True (tests/kernels/sm90_compile.py), so the GPU-only branch cannot break unseen on CPU."""
import os

import pytest

import sm90_compile  # noqa: F401  (snapshots triton.language before any interpreted launch)


@pytest.fixture(autouse=True)
def _lower_pdl_branches(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if "PDL" in self.arg_names:
            launches.append((self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    yield
    from sm90_compile import lower_with_pdl
    for fn, args, kwargs in launches:
        lower_with_pdl(fn, args, kwargs)
