"""Reads a GGUF file with gguf-py's GGUFReader and dumps what it finds, for the Rust writer's test.

Usage: read_back.py FILE OUT_DIR. Writes OUT_DIR/summary.json (metadata contents, tensor types and
shapes) and OUT_DIR/NAME.deq (gguf-py's dequantization of each tensor, f32 little-endian).
"""
import json
import sys
from pathlib import Path

import numpy as np
import gguf

reader = gguf.GGUFReader(sys.argv[1])
out = Path(sys.argv[2])
summary = {"alignment": reader.alignment, "metadata": {}, "tensors": {}}
for name, field in reader.fields.items():
    if name.startswith("GGUF."):
        continue
    value = field.contents()
    summary["metadata"][name] = {"types": [int(t) for t in field.types], "value": value}
for t in reader.tensors:
    summary["tensors"][t.name] = {"type": t.tensor_type.name, "dims": [int(d) for d in t.shape]}
    gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).tofile(out / f"{t.name}.deq")
(out / "summary.json").write_text(json.dumps(summary))
