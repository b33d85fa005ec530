"""Start-up cost that a fresh process pays: building the model (on the meta device, then
storage on the target) must not import torch._dynamo. nn.Embedding's own random init did,
through torch's Python reference ops on meta tensors: ~1.3 s of every job's start-up on the
CI machine, for weights the loader overwrites anyway."""
import subprocess
import sys

CODE = """
import sys, torch
from batchrun.bench.build import model_config_of
from batchrun.engine.models.loader import _materialise
for name in ("tiny", "llama-2-7b"):
    cfg = model_config_of(name)
    if name == "tiny":
        _materialise(cfg, torch.device("cpu"), torch.float32, 64)
    else:  # the 7b's shapes on the meta device only (no storage)
        from batchrun.engine.models.decoder import CausalLM
        with torch.device("meta"):
            CausalLM(cfg, 64)
print("torch._dynamo" in sys.modules)
"""


def test_building_the_model_does_not_import_dynamo():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", (
        "building the model imported torch._dynamo (a parameter's init ran on the meta device?)")
