"""Fingerprints of the Pallas kernels' compiled form, taken on any machine: a restructure of the
kernels' Python that leaves every fingerprint equal leaves the GPU code unchanged.

Each variant (the grouped GEMMs at every row of ``TILES`` and the configurations the tests
cover, MegaAttention over every pool mix, split and grid) is lowered for CUDA (no GPU needed)
at V4.1-Flash shapes. Lowering yields the Mosaic GPU module each kernel compiles from; its text
without source locations (which move with every edit) is hashed. Usage::

    python bench/kernel_ir.py > before.json     # on the old tree
    python bench/kernel_ir.py --compare before.json   # on the new: exit 1 naming what changed
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src.interpreters import mlir as jax_mlir  # noqa: E402  (a context with the standard dialects)
from jax._src.lib.mlir import ir  # noqa: E402
from jax.experimental.mosaic import gpu as mgpu  # noqa: E402

from pallas_kernels.block_scaled import Fp4Weight, Fp8Pool, Fp8Rows, Nvfp4Pool, QuantizedWeight, scale_row  # noqa: E402
from pallas_kernels.grouped_gemm import GemmConfig, grouped_matmul, grouped_swiglu  # noqa: E402
from pallas_kernels.grouped_gemm_tiles import TILES  # noqa: E402
from pallas_kernels.sparse_attention import sparse_mqa  # noqa: E402

SDS = jax.ShapeDtypeStruct
EXPERTS, HIDDEN, INTER = 6, 5120, 2304        # V4.1-Flash: one rank's routed experts
HEADS, HEAD_DIM = 64, 512
# beyond TILES: (gate/up, down) pairs the kernel tests cover (split m, persistent, grouped order)
C = GemmConfig
EXTRA_GEMMS = {
    "bf16": [(C(64, 64, 64, 2), C(64, 64, 64, 2)), (C(64, 64, 64, 2, 2), C(64, 64, 64, 2, 2)),
             (C(64, 64, 64, 2, 2, "n"), C(64, 64, 64, 2, 2, "n")),
             (C(16, 128, 64, 2, 2, "n", swap_ab=True), C(16, 128, 64, 2, 2, "n", swap_ab=True)),
             (C(64, 64, 64, 2, 2, persistent=True), C(64, 256, 64, 2, 2, persistent=True)),
             (C(64, 64, 64, 2, 2, persistent=True, group_m=3), C(64, 64, 64, 2, 2, persistent=True, group_m=3))],
    "fp8": [(C(64, 128, 64, 4), C(64, 128, 64, 4)), (C(64, 128, 64, 4, 2, "n"), C(64, 128, 64, 4, 2, "n")),
            (C(32, 128, 128, 4, 2, "n", swap_ab=True), C(32, 128, 128, 4, 2, "n", swap_ab=True))],
    "w8a8": [(C(64, 128, 256, 2, 2, "n", swap_ab=True), C(64, 128, 256, 3, swap_ab=True)),
             (C(64, 128, 128, 4, 2, "n", swap_ab=True), C(128, 128, 128, 3, 2, "n", swap_ab=True))],
}


def _weight(fmt: str, shape: tuple) -> object:
    e, n, k = shape
    if fmt == "mxfp4":
        return Fp4Weight(SDS(shape, jnp.int4), SDS((e, k // 32, n), jnp.float16), SDS((e,), jnp.float32))
    if fmt in ("fp8", "w8a8"):
        return QuantizedWeight(SDS(shape, jnp.float8_e4m3fn), SDS((e, n // 128, k // 128), jnp.float32),
                               SDS((e, n // 128, scale_row(k // 128)), jnp.float32), SDS((e, n // 128), jnp.float32))
    return SDS(shape, jnp.bfloat16)


def _rows(fmt: str, m: int, k: int) -> object:
    if fmt == "w8a8":
        return Fp8Rows(SDS((m, k), jnp.float8_e4m3fn), SDS((k // 128, m), jnp.float32))
    return SDS((m, k), jnp.bfloat16)


def gemm_variants():
    """(name, jitted function, argument shapes) of each grouped GEMM variant."""
    for fmt, table in TILES.items():
        pairs = [(row.gate_up, row.down) for row in table] + EXTRA_GEMMS.get(fmt, [])
        for cfg in dict.fromkeys(up for up, _ in pairs):
            m = cfg.rows * 8
            fp8_out = fmt == "w8a8" and cfg.quantizes_h
            shared = tuple(_squeeze(_weight(fmt, (1, INTER, HIDDEN))) for _ in range(2))
            yield (f"grouped_swiglu/{fmt}/{cfg}", jax.jit(
                lambda x, a, b, i, s, sh, cfg=cfg, fp8_out=fp8_out: grouped_swiglu(
                    x, a, b, i, limit=10.0, row_scale=s, shared=sh, cfg=cfg, fp8_out=fp8_out)),
                (_rows(fmt, m, HIDDEN), _weight(fmt, (EXPERTS, INTER, HIDDEN)), _weight(fmt, (EXPERTS, INTER, HIDDEN)),
                 SDS((m // cfg.rows,), jnp.int32), SDS((m,), jnp.float32), shared))
        for cfg in dict.fromkeys(down for _, down in pairs):
            m = cfg.rows * 8
            yield (f"grouped_matmul/{fmt}/{cfg}", jax.jit(lambda h, w, i, cfg=cfg: grouped_matmul(h, w, i, cfg=cfg)),
                   (_rows(fmt, m, INTER), _weight(fmt, (EXPERTS, HIDDEN, INTER)), SDS((m // cfg.rows,), jnp.int32)))


def _squeeze(w):
    """A one-expert stack as the single weight the kernels' ``shared`` takes."""
    return type(w)(*(SDS(a.shape[1:], a.dtype) for a in w)) if isinstance(w, tuple) else SDS(w.shape[1:], w.dtype)


def attention_variants():
    """(name, jitted function, argument shapes) of each MegaAttention variant: a window pool and a
    compressed pool of every kind mix, with one split per query or four, one CTA per item or persistent."""
    def pool(t, n, s, kind):
        idx = SDS((t, s), jnp.int32)
        if kind == "fp8":
            return Fp8Pool(SDS((n, HEAD_DIM), jnp.float8_e4m3fn), SDS((n, HEAD_DIM // 32), jnp.uint8), idx)
        if kind == "nvfp4":
            return Nvfp4Pool(SDS((n, HEAD_DIM // 2), jnp.uint8), SDS((n, HEAD_DIM // 16), jnp.float8_e4m3fn), idx)
        return SDS((n, HEAD_DIM), jnp.bfloat16), idx

    # (window pool, compressed pool) kinds: "fp8+nvfp4" is the stored layout V4.1 serves
    for kinds in ("bf16", "fp8+bf16", "fp8", "fp8+nvfp4", "bf16+nvfp4"):
        window, comp = kinds.split("+") if "+" in kinds else (kinds, kinds)
        for t, splits, ctas in ((256, 1, 256), (4096, 1, 132), (32, 4, None)):
            pools = [pool(t, n, s, k) for (n, s), k in zip([(128 * 256, 128), (32768 * 64, 512)], (window, comp))]
            yield (f"sparse_mqa/{kinds}/t={t},splits={splits},ctas={ctas}",
                   jax.jit(lambda q, p, s, splits=splits, ctas=ctas: sparse_mqa(
                       q, p, s, HEAD_DIM ** -0.5, splits=splits, ctas=ctas)),
                   (SDS((t, HEADS, HEAD_DIM), jnp.bfloat16), pools, SDS((HEADS,), jnp.float32)))


_MODULE = re.compile(r'custom_call @mosaic_gpu\w*\(.*?module = "((?:[^"\\]|\\.)*)"')


def _unescape(s: str) -> bytes:
    """The bytes of an MLIR string attribute as printed (``\\XX`` hex escapes)."""
    out, i = bytearray(), 0
    while i < len(s):
        if s[i] != "\\":
            out += s[i].encode()
            i += 1
        elif s[i + 1] in '\\"':
            out.append(ord(s[i + 1]))
            i += 2
        else:
            out.append(int(s[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def fingerprints(fn, args, dump: Path | None = None) -> list[str]:
    """The hash of each Mosaic GPU module ``fn`` lowers to for CUDA, printed without locations
    (with ``dump``, the text itself is written there under its hash, for diffing)."""
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    ctx = jax_mlir.make_ir_context()
    ctx.allow_unregistered_dialects = True   # the kernel's stable_mosaic_gpu wrapper ops
    mgpu.dialect.register_dialect(ctx)
    out = []
    with ctx:
        for raw in _MODULE.findall(text):
            asm = ir.Module.parse(_unescape(raw)).operation.get_asm(enable_debug_info=False)
            out.append(hashlib.sha256(asm.encode()).hexdigest()[:16])
            if dump is not None:
                dump.mkdir(parents=True, exist_ok=True)
                (dump / f"{out[-1]}.mlir").write_text(asm)
    if not out:
        raise RuntimeError("no Mosaic GPU kernel in the lowered module")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", type=Path, help="a previous run's JSON: exit 1 if any variant differs")
    ap.add_argument("--only", default="", help="variants whose name contains this")
    ap.add_argument("--dump", type=Path, help="write each module's text to this folder")
    args = ap.parse_args()
    result = {}
    for name, fn, shapes in [*gemm_variants(), *attention_variants()]:
        if args.only in name:
            result[name] = fingerprints(fn, shapes, args.dump)
            print(f"{name}: {' '.join(result[name])}", file=sys.stderr, flush=True)
    if args.compare is None:
        json.dump(result, sys.stdout, indent=1)
        return 0
    before = {k: v for k, v in json.loads(args.compare.read_text()).items() if args.only in k}
    changed = sorted(k for k in result.keys() | before.keys() if result.get(k) != before.get(k))
    for name in changed:
        print(f"changed: {name}: {before.get(name)} -> {result.get(name)}")
    print(f"{len(result) - len(changed)} of {len(result)} variants equal")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
