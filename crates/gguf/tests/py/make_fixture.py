"""Writes a GGUF file with gguf-py (the reference implementation) for the Rust reader to check.

Usage: make_fixture.py OUT_DIR. Writes OUT_DIR/fixture.gguf and, per tensor NAME, OUT_DIR/NAME.input
(the f32 values quantized, little-endian) and OUT_DIR/NAME.deq (gguf-py's dequantization of the
stored data).
"""
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

out = Path(sys.argv[1])
rng = np.random.default_rng(1234)

w = gguf.GGUFWriter(out / "fixture.gguf", "llama")
w.add_custom_alignment(64)
w.add_uint32("test.u32", 123456)
w.add_int32("test.i32", -42)
w.add_float32("test.f32", 0.125)
w.add_float64("test.f64", 2.5)
w.add_bool("test.bool", True)
w.add_uint64("test.u64", 1 << 40)
w.add_string("test.str", "héllo")
w.add_array("test.strings", ["<s>", "Ġthe", "\u00e9"])
w.add_array("test.ints", [3, -1, 7])
w.add_array("test.floats", [0.5, -2.0])

tensors = {
    # name: (row-major shape, type)
    "norm": ((96,), T.F32),
    "plain": ((3, 64), T.F32),
    "half": ((5, 64), T.F16),
    "q8": ((6, 96), T.Q8_0),
    "q41": ((7, 128), T.Q4_1),
    "q40": ((4, 64), T.Q4_0),
}
for name, (shape, ty) in tensors.items():
    x = (rng.standard_normal(shape) * 0.7).astype(np.float32)
    # A constant block and an exact half-step make the quantizers' edge cases part of the check.
    if x.ndim == 2:
        x[0, :32] = 0.25
        x[1, 0] = 0.0
    x.tofile(out / f"{name}.input")
    q = gguf.quants.quantize(x, ty)
    w.add_tensor(name, q, raw_dtype=ty)
    gguf.quants.dequantize(q, ty).astype(np.float32).tofile(out / f"{name}.deq")

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
