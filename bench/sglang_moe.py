"""SGLang's Triton fused MoE, run as a peer from its wheel (``sglang`` installed without dependencies).

What an SGLang user runs for a DeepSeek MoE layer on Hopper without DeepGEMM: ``fused_experts``'s
two ``fused_moe_kernel`` launches (gate/up, then down with the routing weights) around
``act_and_mul_triton``, in bf16 or W8A8 block-fp8 (activations quantised per token per 128
columns inside each launch's call, so inside the timed call, where ours take rows already
quantised, as the dispatch writes them). The kernels' module and its launch wrapper
(``invoke_fused_moe_kernel``) are loaded from the wheel's files as they are; only what they
import from the rest of SGLang (its CUDA extension ``sgl_kernel``, DeepGEMM, the server's
arguments) is replaced by the small stand-ins below. ``fused_experts`` here is
``fused_experts_impl``'s sequence of those calls for rows already routed (one expert a row, so
top-k 1 and no sum; its config looked up with M = the rows). Three substitutions, each stated
in the results:

- ``moe_align_block_size`` (``sgl_kernel``'s CUDA op) is computed here in torch, before timing;
- the activations' per-token-group fp8 quantiser is SGLang's own Triton one
  (``per_token_group_quant_fp8``) instead of ``sgl_kernel``'s CUDA one;
- the clamped SwiGLU (``gemm1_limit``, a ``torch.compile`` of SGLang's) is its plain
  ``act_and_mul_triton``: the benchmark's rows never reach the clamp.

Configs: SGLang's tuned file for the shape on this device if the wheel has one, otherwise its
default (``get_default_config``), and beside it the tuned file of the nearest shape it ships for
this device and dtype (the best case for the peer short of tuning it here).
"""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import math
import os
import sys
import types
from pathlib import Path

_LOADED: dict = {}


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load() -> types.SimpleNamespace:
    """The wheel's fused-MoE kernels module, its config module and its Triton fp8 quantiser."""
    if _LOADED:
        return _LOADED["sgl"]
    import torch

    found = importlib.util.find_spec("sglang")
    if found is None:
        raise ImportError("the sglang wheel is not installed (pip install --no-deps sglang)")
    root = Path(found.submodule_search_locations[0])
    # the packages on the way, without their __init__ (which import the whole server)
    for package in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.quantization",
                    "sglang.srt.layers.moe", "sglang.srt.layers.moe.fused_moe_triton"):
        _stub(package, __path__=[str(root.joinpath(*package.split(".")[1:]))])

    cuda = [False]   # what ``is_cuda`` answers while a module is imported (see below)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    _stub("sglang.srt.utils",
          is_cuda=lambda: cuda[0], is_hip=lambda: False, is_cpu=lambda: False, is_xpu=lambda: False,
          cpu_has_amx_support=lambda: False, is_sm90_supported=lambda: capability == (9, 0),
          is_sm100_supported=lambda: False, is_sm120_supported=lambda: False,
          get_bool_env_var=lambda name, default="false": os.environ.get(name, default).lower() in ("1", "true"),
          get_device_name=lambda device_id=0: torch.cuda.get_device_name(device_id),
          get_device_core_count=lambda device_id=0: torch.cuda.get_device_properties(device_id).multi_processor_count,
          ceil_align=lambda x, a: -(-x // a) * a, log_info_on_rank0=lambda logger, msg: logger.info(msg))
    _stub("sglang.srt.utils.custom_op", register_custom_op=lambda *a, **k: (lambda f: f))
    _stub("sglang.srt.utils.patch_torch", register_fake_if_exists=lambda *a, **k: (lambda f: f))
    _stub("sglang.srt.layers.deep_gemm_wrapper", ENABLE_JIT_DEEPGEMM=False)
    _stub("sglang.srt.batch_invariant_ops", is_batch_invariant_mode_enabled=lambda: False)
    _stub("sglang.srt.server_args", get_global_server_args=lambda: types.SimpleNamespace(
        enable_deterministic_inference=False, enable_fused_moe_sum_all_reduce=False))

    def absent(*_, **__):
        raise NotImplementedError("int8 MoE is not part of this benchmark")
    _stub("sglang.srt.layers.quantization.int8_kernel", per_token_group_quant_int8=absent,
          per_token_quant_int8=absent, sglang_per_token_group_quant_int8=absent)

    moe_dir = root / "srt" / "layers" / "moe" / "fused_moe_triton"
    # the fp8 quantiser module imports sgl_kernel's CUDA ops when is_cuda(): import it as on a
    # machine without them, which leaves its Triton kernels; the MoE modules then see CUDA (so
    # that SM90's swap-AB launch path is taken) and quantise through that Triton kernel
    fp8 = _load("sglang.srt.layers.quantization.fp8_kernel", root / "srt" / "layers" / "quantization" / "fp8_kernel.py")
    cuda[0] = True
    kernels = _load("sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels",
                    moe_dir / "fused_moe_triton_kernels.py")
    kernels.sglang_per_token_group_quant_fp8 = fp8.per_token_group_quant_fp8
    config = _load("sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config",
                   moe_dir / "fused_moe_triton_config.py")
    logging.getLogger(config.__name__).setLevel(logging.ERROR)
    from importlib.metadata import version
    _LOADED["sgl"] = types.SimpleNamespace(kernels=kernels, config=config, fp8=fp8, version=version("sglang"),
                                           config_dir=moe_dir / "configs")
    return _LOADED["sgl"]


def align(expert_of_row, block_m: int, experts: int):
    """``moe_align_block_size`` for one expert a row, in torch: each expert's rows padded to a
    multiple of ``block_m`` (pad id = the row count), the expert of every block, and the padded
    total, in the buffers' sizes SGLang allocates (which set the launch grid)."""
    import torch

    n = expert_of_row.numel()
    capacity = n * block_m if n < experts + 1 else n + (experts + 1) * (block_m - 1)
    counts = torch.bincount(expert_of_row, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(expert_of_row, stable=True)
    rank = torch.arange(n, device=order.device) - (torch.cumsum(counts, 0) - counts)[expert_of_row[order]]
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=order.device)
    sorted_ids[starts[expert_of_row[order]] + rank] = order.to(torch.int32)
    expert_ids = torch.full((math.ceil(capacity / block_m),), -1, dtype=torch.int32, device=order.device)
    expert_ids[: int(padded.sum()) // block_m] = torch.repeat_interleave(
        torch.arange(experts, device=order.device), padded // block_m).to(torch.int32)
    return sorted_ids, expert_ids, padded.sum().reshape(1).to(torch.int32)


def configs(m: int, experts: int, n: int, k: int, fp8: bool) -> dict:
    """name → kernel config: SGLang's pick for this shape on this device (its tuned file, else its
    default), and the nearest shipped shape's tuned config for this device and dtype."""
    sgl = load()
    dtype = "fp8_w8a8" if fp8 else None
    block = [128, 128] if fp8 else None
    tuned = sgl.config.get_moe_configs(experts, n, dtype, *(block or (0, 0)))
    picked = {"sglang": dict(tuned[min(tuned, key=lambda x: abs(x - m))]) if tuned else
              sgl.config.get_default_config(m, experts, n, k, 1, dtype, False, block)}
    nearest = _nearest_file(experts, n, dtype, block)
    if nearest is not None and not tuned:
        table = {int(key): val for key, val in json.loads(nearest.read_text()).items()}
        picked[f"nearest {nearest.name.split(',device')[0]}"] = dict(table[min(table, key=lambda x: abs(x - m))])
    return picked


def _nearest_file(experts: int, n: int, dtype, block):
    import torch

    sgl = load()
    device = torch.cuda.get_device_name().replace(" ", "_")
    suffix = (f",device_name={device}" + (f",dtype={dtype}" if dtype else "")
              + (f",block_shape={block}" if block else ""))
    best = None
    for path in sorted(sgl.config_dir.glob(f"*/E=*{glob.escape(suffix)}.json")):
        e, nn = (int(part.split("=")[1]) for part in path.name.split(",")[:2])
        distance = abs(math.log(e / experts)) + abs(math.log(nn / n))
        if best is None or distance <= best[0]:   # (directories by Triton version, ascending: the newest wins)
            best = (distance, path)
    return best[1] if best else None


def fused_experts(x, w13, w2, plan, config: dict, scales=None):
    """``fused_experts_impl``'s launches for rows already routed (one expert a row, weight 1):
    gate/up GEMM, SiLU-and-mul, down GEMM. ``plan``: (expert of each row, ``align``'s output for
    ``config``'s BLOCK_SIZE_M); ``scales``: W8A8's (w13 scale, w2 scale) [E, N/128, K/128]."""
    import torch
    import triton.language as tl

    sgl = load()
    expert_of_row, (sorted_ids, expert_ids, post_padded) = plan
    m, n = x.shape[0], w13.shape[1]
    ones = torch.ones((m, 1), dtype=torch.float32, device=x.device)
    topk_ids = expert_of_row.view(m, 1)
    fp8 = scales is not None
    common = dict(compute_type=tl.bfloat16, use_fp8_w8a8=fp8, use_int8_w8a8=False, use_int8_w8a16=False,
                  use_int4_w4a16=False, per_channel_quant=False, block_shape=[128, 128] if fp8 else None)
    h1 = torch.empty((m, n), device=x.device, dtype=x.dtype)
    sgl.kernels.invoke_fused_moe_kernel(x, w13, None, h1, None, scales[0] if fp8 else None, None, ones, topk_ids,
                                        sorted_ids, expert_ids, post_padded, False, 1, config, **common)
    h2 = torch.empty((m, n // 2), device=x.device, dtype=x.dtype)
    sgl.kernels.act_and_mul_triton(h1, h2, config, topk_ids, expert_ids, False, "silu")
    out = torch.empty((1, m, w2.shape[1]), device=x.device, dtype=x.dtype)
    sgl.kernels.invoke_fused_moe_kernel(h2, w2, None, out, None, scales[1] if fp8 else None, None, ones, topk_ids,
                                        sorted_ids, expert_ids, post_padded, True, 1, config, **common)
    return out[0]


def self_check(experts: int = 6, hidden: int = 512, inter: int = 256, per_expert: int = 16) -> int:
    """The peer's launches on random rows against a torch reference, bf16 then W8A8, each launch
    synchronised (``CUDA_LAUNCH_BLOCKING``): 0 if they agree, 1 otherwise. Run as its own process
    (``python bench/sglang_moe.py``) by ``moe_gpu.py`` before it takes the peer, so that a launch
    that faults (which poisons its CUDA context) costs the peer and not the benchmark."""
    import torch

    torch.manual_seed(0)
    dev = "cuda"
    counts = torch.full((experts,), per_expert, device=dev)
    expert = torch.repeat_interleave(torch.arange(experts, device=dev), counts)
    x = torch.randn(len(expert), hidden, device=dev, dtype=torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=dev) * hidden ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device=dev) * inter ** -0.5).to(torch.bfloat16)
    want = torch.empty(len(expert), hidden, device=dev)
    for e in range(experts):
        rows = expert == e
        h = x[rows].float() @ w13[e].float().T
        want[rows] = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(torch.bfloat16).float() @ w2[e].float().T
    status = 0
    for fp8 in (False, True):
        for label, config in configs(len(expert), experts, 2 * inter, hidden, fp8).items():
            a, b, scales = w13, w2, None
            if fp8:   # e4m3 weights x 16 under a 1/16 scale a 128 x 128 block (kept off e4m3's subnormals)
                a, b = ((w.float() * 16).to(torch.float8_e4m3fn) for w in (w13, w2))
                scales = tuple(torch.full((experts, w.shape[1] // 128, w.shape[2] // 128), 1 / 16, device=dev)
                               for w in (w13, w2))
            plan = (expert, align(expert, config["BLOCK_SIZE_M"], experts))
            got = fused_experts(x, a, b, plan, config, scales).float()
            torch.cuda.synchronize()
            err = float((got - want).norm() / want.norm())
            ok = err < (0.08 if fp8 else 0.02)
            status |= not ok
            print(f"sglang fused MoE {'w8a8' if fp8 else 'bf16'} [{label}]: rel err {err:.2e}"
                  + ("" if ok else "  MISMATCH"), flush=True)
    return status


if __name__ == "__main__":
    os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
    sys.exit(self_check())
