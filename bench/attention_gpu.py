"""V4.1 sparse sink MQA on the GPU: our Mosaic GPU kernel against the XLA path, with a roofline.

Cases (H=64 heads, D=512, bf16; every query reads 128 window rows + 512 compressed rows):
- decode: B in {8, 32, 64, 128, 256} requests x 4 queries (1 + 3 draft tokens) at 128K
  context: window rows from a per-request ring of 128, top-512 distinct rows from the
  request's own pool of 128K/4 = 32K compressed rows;
- prefill: T in {4K, 16K, 64K} new tokens of one request at 128K context: the window is the
  127 rows before each token (ring + the chunk's own KV), top-512 from the 32K pool.

Implementations: ``pallas_bf16`` (pallas_kernels.sparse_attention.sparse_mqa) and ``xla_bf16``
(gather + two bf16 einsums with fp32 accumulation + softmax, jitted; run with lax.map over
query chunks where one shot would not fit, which the row says). Each kernel row carries
``rel_err`` against the fp32 reference (sparse_mqa_reference) on a sample of query tokens,
``rel_err_vs_xla`` over all tokens, and ``finite`` (no NaN/Inf anywhere in the output).
``pallas_fp8`` is the same kernel with the window pool in FP8 (e4m3 + one power-of-two scale
per 32 channels as its UE8M0 byte, MODEL_SPEC §3.5, quantised from the bf16 window pool) and the
compressed pool in bf16. Its ``rel_err`` is against the
fp32 reference on the same fp8 pools (dequantised); ``quant_err`` is that reference against
the bf16 one (the effect of the quantisation itself, not of the kernel). ``pallas_stored`` is
the layout ``--kv-cache-dtype fp8_e4m3`` serves: the FP8 window and the compressed pool as
NVFP4 records (``Nvfp4Rows``: 256 code bytes + 32 e4m3 scale bytes a row), each checked the
same way against its own dequantised pools. ``mega_attention_stored`` is the operator the model
calls (``mega.attention``) on those pools: the kernel plus the query RoPE and the output's inverse
RoPE as XLA passes, so its time less ``pallas_stored``'s is what fusing them could save.

Roofline per case: max(FLOPs / measured bf16 matmul rate, bytes / measured copy bandwidth),
FLOPs = 4*T*H*S*D, bytes = q read + out write + the distinct KV rows that are gathered
(counted per request for decode). For ``pallas_fp8`` (``roofline_fp8_ms``, the row's own
``bytes``) a distinct window row counts D + D/32 bytes (512 values + 16 UE8M0 scale bytes)
instead of 2*D, and for ``pallas_stored`` a distinct compressed row D/2 + D/16.
Timing: ``ms`` by ``gpu_common.time_jax_sets`` (back-to-back calls, one wait, median of 5),
rotating among input sets so that repeats do not run from L2; ``ms_one_dispatch`` by
``time_jax_one_dispatch`` (all input sets in one jitted call), which small cases need: there
one host dispatch per call takes longer than the GPU work; ``gpu_span_ms`` and ``gpu_busy_ms``
(``gpu_common.gpu_timeline``) from a profiler trace of back-to-back calls: the GPU's first
kernel start to last kernel end per call, and its summed kernel time per call.

    PYTHONUNBUFFERED=1 python3 bench/attention_gpu.py           # on the H200, ~3-4 minutes
    python3 bench/attention_gpu.py --smoke                      # CPU: tiny shapes, interpret mode
    python3 bench/attention_gpu.py --plot                       # PNG from $OUT/attention_gpu.json
    python3 bench/attention_gpu.py --cases decode-32 --stages   # + stage-removal timings
    python3 bench/attention_gpu.py --per-item   # + the kernels on one CTA per item (not persistent)
    python3 bench/attention_gpu.py --persistent # + the kernels on one CTA per SM (the default's grid, pinned)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (ceilings, gpu_timeline, rel_err, run_info, time_jax_one_dispatch,  # noqa: E402
                        time_jax_sets, write)

from pallas_kernels.sparse_attention import (  # noqa: E402
    STAGES, sparse_mqa, sparse_mqa_reference)
from pallas_kernels.sparse_attention_tiles import TUNING, launch  # noqa: E402
from model.quant import fp8_block32_parts  # noqa: E402
from pallas_kernels.block_scaled import Fp8Pool, Nvfp4Pool, Nvfp4Rows, ue8m0  # noqa: E402
from mega.attention import attention as mega_attention  # noqa: E402
from mega.primitives import apply_rope  # noqa: E402

L2_BYTES = 60e6


def xla_bf16(q, pools, sink, scale, chunk=None):
    """The XLA path in bf16 (fp32 accumulation and softmax); lax.map over query chunks if asked."""
    def one(q, idxs):
        keys = jnp.concatenate([kv[jnp.maximum(i, 0)] for (kv, _), i in zip(pools, idxs)], 1)
        valid = jnp.concatenate([i >= 0 for i in idxs], 1)
        logits = jnp.einsum("thd,tsd->ths", q, keys, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(valid[:, None], logits, -jnp.inf)
        m = jnp.maximum(logits.max(-1), sink[None])
        p = jnp.exp(logits - m[..., None])
        den = jnp.exp(sink[None] - m) + p.sum(-1)
        out = jnp.einsum("ths,tsd->thd", (p / den[..., None]).astype(q.dtype), keys,
                         preferred_element_type=jnp.float32)
        return out.astype(q.dtype)

    idxs = [i for _, i in pools]
    t = q.shape[0]
    if not chunk or t <= chunk:
        return one(q, idxs)
    split = lambda x: x.reshape(t // chunk, chunk, *x.shape[1:])
    out = jax.lax.map(lambda a: one(*a), (split(q), [split(i) for i in idxs]))
    return out.reshape(q.shape)


def make_case(kind, n, h, d, win, topk, comp_pool, rng):
    """Pools (shared by all input sets) and a function drawing one (q, idx...) input set."""
    if kind == "decode":
        reqs, t = n, 4 * n
        n_win, n_comp = reqs * win, reqs * comp_pool
        req = np.repeat(np.arange(reqs), 4)[:, None]
        widx = np.broadcast_to(req * win + np.arange(win), (t, win))
        base = req * comp_pool
    else:
        reqs, t = 1, n
        n_win, n_comp = win + t, comp_pool                        # ring of the previous 128 + the chunk
        widx = win + np.arange(t)[:, None] - np.arange(win)[None, :]  # tokens t-127 .. t
        base = np.zeros((t, 1), np.int64)
    stride = comp_pool // topk

    def draw(seed):
        r = np.random.default_rng(seed)
        # topk distinct rows spread over the pool (one per stride bucket), like a top-k selection
        cidx = base + np.arange(topk) * stride + r.integers(0, stride, (t, topk))
        q = jax.random.normal(jax.random.key(seed), (t, h, d), jnp.bfloat16)  # on device: GBs at 64K
        return q, jnp.asarray(widx, jnp.int32), jnp.asarray(cidx, jnp.int32)

    def distinct_rows(widx_, cidx_):
        """(distinct window rows, distinct compressed rows) gathered by one input set."""
        count = lambda r: int(np.count_nonzero(np.bincount(np.asarray(r).ravel())))  # noqa: E731
        return count(widx_), count(cidx_)

    seed = int(rng.integers(1 << 30))
    pools = (jax.random.normal(jax.random.key(seed), (n_win, d), jnp.bfloat16),
             jax.random.normal(jax.random.key(seed + 1), (n_comp, d), jnp.bfloat16))
    return t, pools, draw, distinct_rows


def run(args):
    smoke = args.smoke
    if smoke:
        from jax._src.pallas.mosaic_gpu.interpret import params as ip
        ip.set_gpu_interpret_mode(ip.InterpretGPUParams())
        h, d, win, topk, comp_pool = 64, 256, 64, 64, 512   # (D 256: the NVFP4 pool's least)
        cases = [("decode", 2), ("prefill", 8)]
        xla_chunk = 4
    else:
        h, d, win, topk, comp_pool = 64, 512, 128, 512, 32768
        cases = [("decode", b) for b in (8, 32, 64, 128, 256)] + [("prefill", t) for t in (4096, 16384, 65536)]
        xla_chunk = 4096
    if args.cases:
        cases = [(k, int(n)) for k, n in (c.split("-") for c in args.cases.split(","))]
    scale = d ** -0.5
    info = run_info()
    ceil = ceilings(smoke=smoke)
    print("ceilings:", json.dumps(ceil), flush=True)
    rows, roof, roof8, roof_stored = [], {}, {}, {}
    rng = np.random.default_rng(0)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)

    # --topk: the same cases at other top-k widths (keys per query), which separates the
    # per-chunk cost from the per-CTA one
    for kind, n, topk in [(k, n, tk) for k, n in cases for tk in (args.topk or [topk])]:
        key = f"{kind}-{n}" + (f"-top{topk}" if args.topk else "")
        case = {"kind": kind, "n": n, "H": h, "D": d, "S": win + topk, "key": key}
        try:
            t, (wkv, ckv), draw, distinct_rows = make_case(kind, n, h, d, win, topk, comp_pool, rng)
            case["T"] = t
            q0, w0, c0 = draw(1)
            chunks = -(-win // TUNING.block_kv) + -(-topk // TUNING.block_kv)   # key chunks per query
            case["kernel_splits"] = launch(t, h, chunks, getattr(jax.devices()[0], "core_count", 0)).splits
            n_w, n_c = distinct_rows(np.asarray(w0), np.asarray(c0))
            kv_bytes = (n_w + n_c) * d * 2
            kv8_bytes = n_w * (d + d // 32) + n_c * d * 2        # fp8 window rows + their scale bytes
            stored_bytes = n_w * (d + d // 32) + n_c * (d // 2 + d // 16)   # and NVFP4 compressed rows
            qo_bytes = 2 * t * h * d * 2
            set_bytes = kv_bytes + qo_bytes
            n_sets = 2 if smoke else min(8, max(2, math.ceil(2 * L2_BYTES / set_bytes)))
            sets = [(q0, w0, c0)] + [draw(s) for s in range(2, n_sets + 1)]
            flops = 4 * t * h * (win + topk) * d
            nbytes = kv_bytes + qo_bytes
            roof[key] = max(flops / ceil["matmul_TFLOPs"] / 1e9, nbytes / ceil["bandwidth_GBps"] / 1e6)
            nbytes8 = kv8_bytes + qo_bytes
            roof8[key] = max(flops / ceil["matmul_TFLOPs"] / 1e9, nbytes8 / ceil["bandwidth_GBps"] / 1e6)
            roof_stored[key] = max(flops / ceil["matmul_TFLOPs"] / 1e9,
                                   (stored_bytes + qo_bytes) / ceil["bandwidth_GBps"] / 1e6)
            case.update(flops=flops, bytes=nbytes, bytes_fp8=nbytes8, bytes_stored=stored_bytes + qo_bytes,
                        input_sets=n_sets)
            print(f"{key}: T={t} sets={n_sets} roofline {roof[key]:.3f} ms (fp8 window: {roof8[key]:.3f} ms)", flush=True)
        except Exception as e:  # noqa: BLE001
            rows.append({"case": case, "impl": "setup", "ms": None, "error": repr(e)})
            traceback.print_exc()
            continue

        # the pools are arguments, not closure constants: captured, they would be baked into
        # the executable (GBs of constants and minutes of compilation)
        pools_of = lambda w, c: [(wkv, w), (ckv, c)]  # noqa: E731  (untimed reference only)
        wkv8, wsc = jax.jit(lambda x: (lambda v, s: (v, ue8m0(s)))(*fp8_block32_parts(x)))(wkv)  # FP8 window (§3.5)
        ckv4 = jax.jit(Nvfp4Rows.from_float)(ckv)   # NVFP4 compressed rows (§3.5), as served
        sets8 = [(q_, w_, c_, wkv8, wsc, ckv) for q_, w_, c_ in sets]
        sets4 = [(q_, w_, c_, wkv8, wsc, *ckv4) for q_, w_, c_ in sets]
        sets = [(q_, w_, c_, wkv, ckv) for q_, w_, c_ in sets]
        stored = jax.jit(lambda q, w, c, a8, asc, codes, cs: sparse_mqa(
            q, [Fp8Pool(a8, asc, w), Nvfp4Pool(codes, cs, c)], sink, scale))
        # the whole operator the model calls: the query RoPE and the output's inverse RoPE around
        # the kernel, as XLA passes (V4.1 rotates the last 64 of 512 channels)
        angles = jnp.asarray(rng.uniform(0, 2 * np.pi, (t, 32)), jnp.float32)
        rope = (jnp.cos(angles), jnp.sin(angles))
        sets_rope = [(*s4, *rope) for s4 in sets4]
        whole = jax.jit(lambda q, w, c, a8, asc, codes, cs, cos, sin: mega_attention(
            q, cos, sin, (a8, asc), w, Nvfp4Rows(codes, cs), c, sink, scale))
        def kernels(**kw):   # (bf16, fp8-window) kernels; no splits=: the automatic choice
            return (jax.jit(lambda q, w, c, a, b: sparse_mqa(q, [(a, w), (b, c)], sink, scale, **kw)),
                    jax.jit(lambda q, w, c, a8, asc, b: sparse_mqa(q, [Fp8Pool(a8, asc, w), (b, c)], sink, scale, **kw)))
        kernel, kernel8 = kernels()
        chosen = [(f"pallas_bf16[splits={k}]", f"pallas_fp8[splits={k}]", *kernels(splits=k)) for k in args.splits
                  if k != case["kernel_splits"] and (k - 1) * -(-chunks // k) < chunks]   # every split non-empty
        if args.per_item and case["kernel_splits"] == 1:   # against the persistent grid: one CTA per item
            chosen.append(("pallas_bf16[one item per CTA]", "pallas_fp8[one item per CTA]",
                           *kernels(ctas=t * h // 64)))
        if args.persistent and case["kernel_splits"] == 1:   # one CTA per SM, as the default
            chosen.append(("pallas_bf16[one CTA per SM]", "pallas_fp8[one CTA per SM]",
                           *kernels(ctas=min(t * h // 64, jax.devices()[0].core_count))))
        chunk = xla_chunk if t > xla_chunk and t % xla_chunk == 0 else None
        xla = jax.jit(lambda q, w, c, a, b: xla_bf16(q, [(a, w), (b, c)], sink, scale, chunk))
        # fp32 reference on a sample of tokens (the full one would take minutes at 64K tokens)
        sample = np.unique(np.linspace(0, t - 1, min(t, 256)).astype(int))
        q, w, c = sets[0][:3]
        ref = sparse_mqa_reference(q[sample], pools_of(w[sample], c[sample]), sink, scale)
        ref8 = sparse_mqa_reference(q[sample], [Fp8Pool(wkv8, wsc, w[sample]), (ckv, c[sample])], sink, scale)
        ref4 = sparse_mqa_reference(q[sample], [Fp8Pool(wkv8, wsc, w[sample]), Nvfp4Pool(*ckv4, c[sample])],
                                    sink, scale)
        cos_s, sin_s = (x[sample][:, None] for x in rope)
        ref_rope = apply_rope(sparse_mqa_reference(apply_rope(q[sample], cos_s, sin_s), [
            Fp8Pool(wkv8, wsc, w[sample]), Nvfp4Pool(*ckv4, c[sample])], sink, scale), cos_s, sin_s, inverse=True)
        forms = {   # impl prefix: (input sets, reference, bytes, roofline, note)
            "mega_attention_stored": (sets_rope, ref_rope, case["bytes_stored"], roof_stored[key],
                                      "mega.attention on pallas_stored's pools: + the q RoPE and the output's "
                                      "inverse RoPE as XLA passes (the fusion's stage-removal pair)"),
            "pallas_stored": (sets4, ref4, case["bytes_stored"], roof_stored[key],
                              "window pool fp8 e4m3 + UE8M0 bytes, compressed pool NVFP4 records"),
            "pallas_fp8": (sets8, ref8, case["bytes_fp8"], roof8[key],
                           "window pool fp8 e4m3 + per-32 UE8M0 scale bytes, compressed pool bf16"),
            "": (sets, ref, case["bytes"], roof[key], None)}

        xla_out = None
        variants = [("xla_bf16", xla), ("pallas_bf16", kernel), ("pallas_fp8", kernel8), ("pallas_stored", stored),
                    ("mega_attention_stored", whole)]
        variants += [v for n16, n8, k16, k8 in chosen for v in ((n16, k16), (n8, k8))]
        for impl, fn in variants:
            form = next(f for f in forms if impl.startswith(f))
            fn_sets, impl_ref, impl_bytes, impl_roof, note = forms[form]
            fp8 = bool(form)   # a stored form: it differs from the bf16 XLA path by quant_err
            row = {"case": case, "impl": impl, "ms": None, "rel_err": None, "error": None}
            if impl == "xla_bf16" and chunk:
                row["note"] = f"lax.map over {t // chunk} query chunks of {chunk}"
            if fp8:
                row["note"] = note
            if fp8 and impl_ref is not ref_rope:
                row["quant_err"] = rel_err(impl_ref, ref)
            try:
                out = jax.block_until_ready(fn(*fn_sets[0]))
                row["finite"] = bool(jnp.isfinite(out).all())
                row["rel_err"] = rel_err(out[sample], impl_ref)
                if xla_out is None:
                    xla_out = out
                elif not fp8:     # (the fp8 row differs from the bf16 XLA path by quant_err)
                    row["rel_err_vs_xla"] = rel_err(out, xla_out)
                timing = {"inner": 2, "reps": 1} if smoke else {}
                row["ms"] = time_jax_sets(fn, fn_sets, **timing)
                row["ms_one_dispatch"] = time_jax_one_dispatch(fn, fn_sets, **timing)
                calls = max(3, len(fn_sets))  # GPU time per call, free of host dispatch gaps
                row.update(gpu_timeline(lambda: jax.block_until_ready(
                    [fn(*fn_sets[i % len(fn_sets)]) for i in range(calls)]), calls))
                row["bytes"] = impl_bytes
                row["roofline_ms"] = impl_roof
                row["GBps"] = row["bytes"] / row["ms"] / 1e6
                row["TFLOPs"] = case["flops"] / row["ms"] / 1e9
                row["frac_of_roofline"] = row["roofline_ms"] / row["ms"]
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:2000]
                traceback.print_exc()
            rows.append(row)
            print(json.dumps(row), flush=True)
        # stage removal (--stages): the bf16 kernel with one stage left out, then all of them;
        # the fp8 kernel without its dequantisation
        bf16_stages = tuple(st for st in STAGES if st != "dequant")
        removals = [("pallas_bf16", (st,)) for st in bf16_stages] + [("pallas_bf16", bf16_stages), ("pallas_fp8", ("dequant",)),
                                                                     ("pallas_stored", ("dequant",))]
        for impl, skip in removals if args.stages else ():
            row = {"case": case, "impl": f"{impl}-skip:" + "+".join(skip), "ms": None,
                   "note": "stage-removal timing only: the output is wrong by design"}
            try:
                if impl == "pallas_stored":
                    fn = jax.jit(lambda q, w, c, a8, asc, codes, cs, skip=skip: sparse_mqa(
                        q, [Fp8Pool(a8, asc, w), Nvfp4Pool(codes, cs, c)], sink, scale, skip_stages=skip))
                elif impl == "pallas_fp8":
                    fn = jax.jit(lambda q, w, c, a8, asc, b, skip=skip: sparse_mqa(
                        q, [Fp8Pool(a8, asc, w), (b, c)], sink, scale, skip_stages=skip))
                else:
                    fn = jax.jit(lambda q, w, c, a, b, skip=skip: sparse_mqa(q, [(a, w), (b, c)], sink, scale, skip_stages=skip))
                row["ms"] = time_jax_sets(fn, forms[impl if impl != "pallas_bf16" else ""][0],
                                          **({"inner": 2, "reps": 1} if smoke else {}))
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:2000]
                traceback.print_exc()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del sets, sets8, sets4, sets_rope, forms, xla_out
        # written after every case: a hang or crash later still leaves the rows so far
        payload = {**info, "ceilings": ceil, "rows": rows, "roofline_ms": roof, "roofline_fp8_ms": roof8,
                   "roofline_stored_ms": roof_stored}
        path = write("attention_gpu", payload)

    payload = {**info, "ceilings": ceil, "rows": rows, "roofline_ms": roof, "roofline_fp8_ms": roof8,
                   "roofline_stored_ms": roof_stored}
    path = write("attention_gpu", payload)
    print(f"\nwrote {path}\n")
    table(payload)
    return path


def table(payload):
    print(f"{'case':>16} {'impl':>12} {'ms':>9} {'roof ms':>9} {'%roof':>6} {'GB/s':>7} {'TFLOP/s':>8} {'rel_err':>8} "
          f"{'ms, 1 disp':>9}")
    for r in payload["rows"]:
        key = r["case"].get("key", f"{r['case']['kind']}-{r['case']['n']}")
        roof = r.get("roofline_ms") or payload["roofline_ms"].get(key)
        if r.get("ms") is None:
            print(f"{key:>16} {r['impl']:>12}  failed: {str(r.get('error'))[:80]}")
            continue
        line = f"{key:>16} {r['impl']:>12} {r['ms']:9.3f} {roof:9.3f} {100 * roof / r['ms']:6.1f}"
        if "GBps" in r:      # (stage-removal rows carry a time only)
            line += f" {r['GBps']:7.0f} {r['TFLOPs']:8.1f} {r['rel_err']:8.1e} {r['ms_one_dispatch']:9.3f}"
        print(line)


def plot(path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    payload = json.loads(path.read_text())
    keys = list(payload["roofline_ms"])
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.plot(keys, [payload["roofline_ms"][k] for k in keys], "k--", label="roofline")
    roof8 = payload.get("roofline_fp8_ms") or {}
    if roof8:
        ax.plot([k for k in keys if k in roof8], [roof8[k] for k in keys if k in roof8], "k:",
                label="roofline, fp8 window")
    for impl in sorted({r["impl"] for r in payload["rows"]}):
        pts = {r["case"].get("key", f"{r['case']['kind']}-{r['case']['n']}"): r["ms"] for r in payload["rows"]
               if r["impl"] == impl and r.get("ms")}
        ax.plot([k for k in keys if k in pts], [pts[k] for k in keys if k in pts], "o-", label=impl)
    ax.set_yscale("log")
    ax.set_ylabel("ms per call")
    ax.set_title(f"V4.1 sparse sink MQA (H=64, D=512, S=640), {payload['device']}, jax {payload['jax_version']}")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=30)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Mosaic GPU interpreter")
    p.add_argument("--plot", action="store_true", help="only plot an existing $OUT/attention_gpu.json")
    p.add_argument("--cases", help="comma-separated subset, e.g. decode-32,prefill-16384")
    p.add_argument("--stages", action="store_true", help="also time the kernel with each stage left out")
    p.add_argument("--splits", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="also time the kernels at these key-split counts, e.g. 1,2,4")
    p.add_argument("--persistent", action="store_true",
                   help="also time the kernels with one CTA per SM (persistent, the default where one split)")
    p.add_argument("--per-item", action="store_true",
                   help="also time the kernels with one CTA per (token, head group) item, not persistent")
    p.add_argument("--topk", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="run each case at these top-k widths instead of V4.1's 512, e.g. 128,512,1536")
    a = p.parse_args()
    out = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "bench_out")) / "attention_gpu.json"
    if a.plot:
        plot(out)
    else:
        plot(run(a))
