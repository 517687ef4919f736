"""Quantize tensors to NF4 with bitsandbytes' own code, for tests/nf4_bitsandbytes.rs.

Each --nf4 PATH:SHAPE names a raw little-endian f32 file and its shape (e.g. 3x7x5). For each,
with compress_statistics False ("single") and True ("double"), this runs on the CPU

    packed, state = bitsandbytes.functional.quantize_4bit(
        w, blocksize=64, quant_type="nf4", compress_statistics=...)
    back = bitsandbytes.functional.dequantize_4bit(packed, state)

and writes OUT/<stem>.<mode>.packed (u8, two codes a byte), .absmax (f32
per block; u8 codes with double quantization), .absmax2 (double: the f32 second-level absmax)
and .dequant (f32). Each --blockwise PATH (raw f32) is quantized with
quantize_blockwise(x, blocksize=256) and the default dynamic map, the 8-bit scheme double
quantization uses, writing OUT/<stem>.codes (u8) and OUT/<stem>.absmax (f32).

    python scripts/check_nf4.py --out DIR [--nf4 PATH:SHAPE]... [--blockwise PATH]...

Prints one JSON line: versions, torch's CPU dispatch and threads, the NF4 quant_map and the
8-bit dynamic map bitsandbytes used (as f32 bit patterns) and, per NF4 case and mode, the
offset's bits and which dequantization path ran.

Two settings make bitsandbytes' result well defined: torch uses one thread (a sum of more than
32768 elements is split across threads, so the double-quantization offset, a torch.mean, would
depend on their number) and, on x86-64, its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 unless set:
with AVX-512 torch sums in 16 lanes instead of 8, and its linspace, part of the dynamic map,
rounds differently).
"""

import argparse
import json
import os
import platform
import sys

if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")


def bits(t):
    import numpy as np

    values = t.detach().cpu().contiguous().numpy().astype(np.float32)
    return [int(b) for b in values.view(np.uint32)]


def write(path, t):
    with open(path, "wb") as f:
        f.write(t.detach().cpu().contiguous().numpy().tobytes())


def read_f32(path):
    import numpy as np
    import torch

    return torch.from_numpy(np.fromfile(path, dtype="<f4").astype(np.float32))


def stem(path):
    return os.path.splitext(os.path.basename(path))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the results")
    ap.add_argument("--nf4", action="append", default=[], metavar="PATH:SHAPE")
    ap.add_argument("--blockwise", action="append", default=[], metavar="PATH")
    args = ap.parse_args()

    import torch
    import bitsandbytes
    import bitsandbytes.functional as F

    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    report = {
        "torch": torch.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "nf4": {},
        "blockwise": [],
    }
    for case in args.nf4:
        path, shape = case.rsplit(":", 1)
        shape = [int(d) for d in shape.split("x")]
        w = read_f32(path).reshape(shape)
        name = stem(path)
        for mode, nested in (("single", False), ("double", True)):
            packed, state = F.quantize_4bit(
                w, blocksize=64, quant_type="nf4", compress_statistics=nested
            )
            back = F.dequantize_4bit(packed, state)
            if tuple(back.shape) != tuple(shape):
                back = back.t()  # bitsandbytes transposes when packed has one row
            base = os.path.join(args.out, f"{name}.{mode}")
            write(base + ".packed", packed)
            write(base + ".absmax", state.absmax)
            write(base + ".dequant", back.float())
            entry = {
                "quant_map": bits(state.code),
                "dequant_path": "python (odd last dim)" if shape[-1] % 2 else "native",
            }
            if nested:
                write(base + ".absmax2", state.state2.absmax)
                entry["offset"] = bits(state.offset.reshape(1))[0]
                entry["nested_blocksize"] = state.state2.blocksize
                entry["dynamic_map"] = bits(state.state2.code)
            report["nf4"][f"{name}.{mode}"] = entry
    for path in args.blockwise:
        codes, state = F.quantize_blockwise(read_f32(path), blocksize=256)
        base = os.path.join(args.out, stem(path))
        write(base + ".codes", codes)
        write(base + ".absmax", state.absmax)
        report["blockwise"].append(stem(path))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
