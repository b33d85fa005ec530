"""Print a saved `bench lora-matrix` JSON as its table, with the paired per-round statistics
recomputed (files from before they existed get them too); --write adds them to the file.

  PYTHONPATH=. python3 benchmarks/show_matrix.py benchmarks/results/<file>.json [--write]
"""
import json
import sys
from pathlib import Path

from batchrun.bench.matrix_stats import add_paired
from batchrun.bench.matrix_report import print_matrix

if __name__ == "__main__":
    path = Path(sys.argv[1])
    result = add_paired(json.loads(path.read_text()))
    print_matrix(result)
    if "--write" in sys.argv[2:]:
        path.write_text(json.dumps(result, indent=1))
