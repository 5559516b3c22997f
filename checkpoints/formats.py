"""The storage formats of V4.1 checkpoints, as types, and ``quantization_config``.

The released V4.1 checkpoint (``config.json``'s ``quantization_config``: ``{"quant_method": "fp8",
"activation_scheme": "dynamic", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
"expert_dtype": "fp4"}``) stores

* the attention projections, the indexer's ``wq_b``, the shared expert, Engram's ``wkv`` and the
  draft's ``main_proj`` (role "linear"/"shared" in ``model.params``) as ``Fp8Blocks``: e4m3
  ``X.weight`` and one power-of-two scale per 32 x 32 block in ``X.scale`` (``F8_E8M0`` bytes,
  ``w = e4m3 * 2**(e - 127)``);
* the routed experts as ``Mxfp4``: ``X.weight`` ``I8`` ``[out, in / 2]``, two e2m1 codes a byte
  (the even column in the low nibble), and ``X.scale`` ``F8_E8M0`` ``[out, in / 32]``;
* the Engram tables as ``Fp8Rows``: e4m3 rows and an ``F8_E8M0`` scale per 32 channels;
* everything else in BF16 (F32: mHC, sinks, router biases).

V4-style checkpoints (``weight_block_size`` [128, 128], float32 scales, fp8 experts) read as
the same types with other parameters. ``CheckpointFormat`` bundles one type per role;
``encode`` / ``decode`` turn a parameter into its stored tensors and back, for the exporter, the
loader and the in-memory copy of an exported model alike.

What a load produces: routed experts stay in the MoE kernels' forms (MXFP4 → ``Fp4Weight``,
fp8 128 x 128 → ``QuantizedWeight``); fp8 linears (and fp8 experts in blocks the kernels do not
take) are dequantised on the device, tensor by tensor, to the model dtype. e4m3 times a power
of two is exact in bf16, so those GEMMs differ from fp8 GEMMs with fp32 accumulation only in
summation order; XLA has no 32 x 32 block-scaled fp8 GEMM, and the linears are ~2% of V4.1's
weight bytes next to the experts'. Engram tables stay e4m3 with their scale bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.quant import fp8_block32_stored
from model.params import ParamSpec
from pallas_kernels.block_scaled import (FP8_MAX, Fp4Weight, QuantizedWeight, fp8_scale_exponent, mxfp4_parts,
                                        pow2_from_exponent, scale_values)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (names, shapes, dtypes or formats)."""


def scale_name(name: str) -> str:
    """The scale tensor beside weight ``name`` (``layers.0.attn.wq_a.weight`` → ``....wq_a.scale``)."""
    return name.removesuffix(".weight") + ".scale"


@dataclass(frozen=True)
class Fp8Blocks:
    """e4m3 weights ``[N, K]`` with one scale per ``block`` (rows x columns) block, as UE8M0
    bytes (``ue8m0``) or float32."""

    block: tuple[int, int] = (32, 32)
    ue8m0: bool = True

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-2], -(-shape[-2] // self.block[0]), -(-shape[-1] // self.block[1]))

    @partial(jax.jit, static_argnums=0)
    def encode(self, w: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """(e4m3 ``[N, K]``, scales): the power of two at or above each block's amax / 448."""
        b = self._blocks(w.astype(jnp.float32))
        e = fp8_scale_exponent(jnp.abs(b).max(axis=(-3, -1))) + 127
        q = jnp.clip(b / pow2_from_exponent(e)[..., :, None, :, None], -FP8_MAX, FP8_MAX)
        q = self._unblocks(q, w.shape).astype(jnp.float8_e4m3fn)
        return q, (e.astype(jnp.uint8) if self.ue8m0 else pow2_from_exponent(e))

    @partial(jax.jit, static_argnums=(0, 3))
    def decode(self, q: jnp.ndarray, s: jnp.ndarray, dtype: Any) -> jnp.ndarray:
        """The weight as ``dtype`` (exact for bf16 and fp32 with power-of-two scales)."""
        b = self._blocks(q.astype(jnp.float32)) * scale_values(s)[..., :, None, :, None]
        return self._unblocks(b, q.shape).astype(dtype)

    def kernel_form(self, q: jnp.ndarray, s: jnp.ndarray) -> QuantizedWeight | None:
        """The MoE kernels' form of an expert weight (their blocks are 128 x 128), or None."""
        if self.block != (128, 128) or q.shape[-2] % 128 or q.shape[-1] % 128:
            return None
        return QuantizedWeight.of(q, scale_values(s))

    def _blocks(self, w: jnp.ndarray) -> jnp.ndarray:
        (br, bc), (n, k) = self.block, w.shape[-2:]
        pad = [(0, 0)] * (w.ndim - 2) + [(0, -n % br), (0, -k % bc)]
        w = jnp.pad(w, pad)
        return w.reshape(*w.shape[:-2], w.shape[-2] // br, br, w.shape[-1] // bc, bc)

    @staticmethod
    def _unblocks(b: jnp.ndarray, shape) -> jnp.ndarray:
        full = b.reshape(*b.shape[:-4], b.shape[-4] * b.shape[-3], b.shape[-2] * b.shape[-1])
        return full[..., :shape[-2], :shape[-1]]


@dataclass(frozen=True)
class Mxfp4:
    """MXFP4 weights ``[N, K]``: e2m1 codes packed two a byte ``[N, K / 2]`` (even column in the
    low nibble) and one UE8M0 exponent byte per 32 ``[N, K / 32]``."""

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] // 2)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] // 32)

    @partial(jax.jit, static_argnums=0)
    def encode(self, w: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        codes, exponents = mxfp4_parts(w)
        packed = (codes[..., 0::2] & 15) | ((codes[..., 1::2] & 15) << 4)
        return packed.astype(jnp.uint8), exponents.astype(jnp.uint8)

    @partial(jax.jit, static_argnums=0)   # one program per shape, not a dozen eager ops per expert
    def decode(self, packed: jnp.ndarray, exponents: jnp.ndarray) -> Fp4Weight:
        return Fp4Weight.from_packed(packed, exponents)


@dataclass(frozen=True)
class Fp8Rows:
    """Engram table rows: e4m3 values and one UE8M0 byte per 32 channels (MODEL_SPEC §3.10)."""

    @staticmethod
    @jax.jit
    def encode(table: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        return fp8_block32_stored(table)


@dataclass(frozen=True)
class CheckpointFormat:
    """How a checkpoint stores each role of ``model.params`` (None: as floats of ``float_dtype``)."""

    linears: Fp8Blocks | None = None
    experts: Mxfp4 | Fp8Blocks | None = None
    tables: Fp8Rows | None = None
    float_dtype: str = "bfloat16"  # what the exporter writes unquantised tensors as

    def of_role(self, role: str) -> Fp8Blocks | Mxfp4 | Fp8Rows | None:
        return {"linear": self.linears, "shared": self.linears, "expert": self.experts,
                "table": self.tables}.get(role)

    # ------------------------------------------------------------------ config.json
    @classmethod
    def from_config(cls, raw: dict) -> "CheckpointFormat":
        """The format ``config.json`` declares; CheckpointError naming an unknown key or value."""
        q = raw.get("quantization_config")
        if q is None and isinstance(raw.get("text_config"), dict):
            q = raw["text_config"].get("quantization_config")
        if q is None:
            return cls(float_dtype=raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")
        if not isinstance(q, dict):
            raise CheckpointError(f"quantization_config must be an object, not {q!r}")

        def bad(key, why):
            raise CheckpointError(f"quantization_config.{key}: {why}")

        unknown = sorted(set(q) - {"quant_method", "activation_scheme", "weight_block_size", "scale_fmt",
                                   "expert_dtype", "fmt"})
        if unknown:
            bad(unknown[0], "unknown key (megajax reads DeepSeek's block-scaled fp8 format: quant_method, "
                            "activation_scheme, weight_block_size, scale_fmt, expert_dtype, fmt)")
        if q.get("quant_method") != "fp8":
            bad("quant_method", f"{q.get('quant_method')!r} is not supported (expected 'fp8')")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            bad("activation_scheme", f"{q['activation_scheme']!r} is not supported (expected 'dynamic')")
        if q.get("fmt", "e4m3") != "e4m3":
            bad("fmt", f"{q['fmt']!r} is not supported (expected 'e4m3')")
        block = q.get("weight_block_size")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            bad("weight_block_size", f"{block!r}: expected two positive integers, e.g. [32, 32]")
        if q.get("scale_fmt", "ue8m0") not in ("ue8m0", None):
            bad("scale_fmt", f"{q['scale_fmt']!r} is not supported (expected 'ue8m0')")
        linears = Fp8Blocks(tuple(block), ue8m0=q.get("scale_fmt", "ue8m0") == "ue8m0")
        expert_dtype = q.get("expert_dtype")
        if expert_dtype not in ("fp4", "fp8", None):
            bad("expert_dtype", f"{expert_dtype!r} is not supported (expected 'fp4' or 'fp8')")
        return cls(linears, Mxfp4() if expert_dtype == "fp4" else linears, Fp8Rows(), "bfloat16")

    def quantization_config(self) -> dict | None:
        if self.linears is None and self.experts is None:
            return None
        if self.linears is None:
            raise ValueError("a quantised checkpoint stores its linears in fp8 (DeepSeek's format)")
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(self.linears.block),
                "scale_fmt": "ue8m0" if self.linears.ue8m0 else None,
                "expert_dtype": "fp4" if isinstance(self.experts, Mxfp4) else "fp8"}

    # ------------------------------------------------------------------ parameters
    def encode(self, spec: ParamSpec, name: str, w, scale=None) -> list[tuple[str, np.ndarray, str | None]]:
        """The stored tensors ``(name, array, raw dtype)`` of tensor ``name`` of ``spec``, value
        ``w`` (an Engram table comes with its ``scale`` leaf, and its scale tensor is written with it)."""
        fmt = self.of_role(spec.role)
        if spec.role == "table_scale" and self.tables is not None:
            return []
        if isinstance(fmt, Mxfp4):
            packed, exps = w.packed() if isinstance(w, Fp4Weight) else fmt.encode(_dense(w))
            return [(name, np.asarray(packed), "I8"), (scale_name(name), np.asarray(exps), "F8_E8M0")]
        if isinstance(fmt, Fp8Blocks):
            q, s = fmt.encode(_dense(w))
            return [(name, np.asarray(q), None), (scale_name(name), np.asarray(s), "F8_E8M0" if fmt.ue8m0 else None)]
        if isinstance(fmt, Fp8Rows):
            q, s = (w, scale) if w.dtype == jnp.float8_e4m3fn else fmt.encode(w)
            return [(name, np.asarray(q), None), (scale_name(name), np.asarray(s), "F8_E8M0")]
        return [(name, np.asarray(_dense(w).astype(spec.dtype(self.float_dtype))), None)]

    def stored_kind(self, spec: ParamSpec, name: str, info, scale) -> str:
        """What tensor ``name`` of ``spec`` is on disk (``info``; ``scale``: its scale tensor's,
        or None): "float", "fp8", "mxfp4", "e4m3" (a table) or "ue8m0" (a table's scales);
        CheckpointError saying why it cannot be read."""
        fmt, dt = self.of_role(spec.role), info.dtype
        want = spec.shape[1:] if spec.stacked else spec.shape
        kind = None
        if dt in FLOAT_DTYPES and scale is None:
            kind = "float"
        elif spec.role == "table_scale" and dt == "F8_E8M0":
            kind = "ue8m0"
        elif spec.role == "table" and dt == "F8_E4M3" and isinstance(fmt, Fp8Rows):
            kind = "e4m3"
        elif dt == "F8_E4M3" and isinstance(fmt, Fp8Blocks):
            self._check_scale(name, scale, fmt.scale_shape(want), ("F8_E8M0",) if fmt.ue8m0 else ("F32",))
            kind = "fp8"
        elif dt in ("I8", "U8") and isinstance(fmt, Mxfp4):
            if want[-1] % 32 or info.shape != fmt.packed_shape(want):
                raise CheckpointError(f"{name}: packed MXFP4 tensor of shape {list(info.shape)}; a {list(want)} "
                                      f"weight packs into {list(fmt.packed_shape(want))}")
            self._check_scale(name, scale, fmt.scale_shape(want), ("F8_E8M0",))
            return "mxfp4"
        if kind is not None:
            if info.shape != want:
                raise CheckpointError(f"{name}: shape {list(info.shape)}, expected {list(want)}")
            return kind
        declared = "no quantization_config" if self.linears is None else f"{self.of_role(spec.role) or 'floats'}"
        raise CheckpointError(f"{name}: dtype {dt}{' with a scale tensor' if scale is not None else ''} is not "
                              f"supported for this tensor (config.json declares {declared} for its role "
                              f"'{spec.role}'; floats are {sorted(FLOAT_DTYPES)})")

    @staticmethod
    def _check_scale(name: str, scale, shape: tuple[int, ...], dtypes: tuple[str, ...]) -> None:
        if scale is None:
            raise CheckpointError(f"{name}: quantised, but its scale tensor {scale_name(name)} is missing")
        if scale.shape != shape or scale.dtype not in dtypes:
            raise CheckpointError(f"{scale_name(name)}: {scale.dtype} {list(scale.shape)} does not match its weight "
                                  f"{name} (expected {' or '.join(dtypes)} {list(shape)})")

    def decode(self, spec: ParamSpec, kind: str, w: jnp.ndarray, scale: jnp.ndarray | None, dtype: Any):
        """One tensor's parameter leaf, on the device, from its stored arrays."""
        fmt = self.of_role(spec.role)
        if kind == "float":
            return w.astype(spec.dtype(dtype))
        if kind in ("e4m3", "ue8m0"):
            return w
        if kind == "mxfp4":
            return fmt.decode(w, scale)
        if spec.role == "expert" and (kernel := fmt.kernel_form(w, scale)) is not None:
            return kernel
        return fmt.decode(w, scale, spec.dtype(dtype))


def _dense(w) -> jnp.ndarray:
    return w.dequantized(jnp.float32) if isinstance(w, (QuantizedWeight, Fp4Weight)) else jnp.asarray(w)


V41 = CheckpointFormat(Fp8Blocks((32, 32)), Mxfp4(), Fp8Rows())  # the released V4.1 layout
BF16 = CheckpointFormat()
FLOAT_DTYPES = {"F32", "F16", "BF16"}
