"""FP8 oracle for tests/fp8_dtype_test.cpp: ml_dtypes' float8_e4m3fn and float8_e5m2.

Prints, per format, the float32 value of each of the 256 bit patterns (decode), then the bit
pattern ml_dtypes rounds each value of a fixed sweep to (encode), for values within the finite
range (ml_dtypes does not saturate; megatrain's scaled casts do, as Transformer Engine's).
Prints SKIP when ml_dtypes is not installed.
"""
import sys

import numpy as np

try:
    import ml_dtypes
except ImportError:
    print("SKIP ml_dtypes is not installed")
    sys.exit(0)

for name, t, fmax in (("e4m3", ml_dtypes.float8_e4m3fn, 448.0), ("e5m2", ml_dtypes.float8_e5m2, 57344.0)):
    bits = np.arange(256, dtype=np.uint8)
    dec = bits.view(t).astype(np.float32)
    print(name, "decode", " ".join(repr(float(v)) for v in dec))
    # The sweep of the C++ side: i * 1.37 * 2^e for i in [-3000, 3000] (float32), e = -6 (e4m3) or 2 (e5m2).
    e = -6 if name == "e4m3" else 2
    xs = (np.arange(-3000, 3001, dtype=np.float32) * np.float32(1.37)) * np.float32(2.0 ** e)
    xs = xs[np.abs(xs) <= fmax]
    enc = xs.astype(t).view(np.uint8)
    print(name, "encode", " ".join(f"{float(x)!r}:{int(b)}" for x, b in zip(xs, enc)))
