"""Shared fixtures: the golden models and a runner for their call patterns."""
from __future__ import annotations

import gc
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The suite's time is XLA compiling the tiny models' step programs. LLVM's first optimisation
# level cuts a fifth of each compile and runs the steps as fast as the default (level 0 cuts a
# third but doubles their time); no fast-math either way: the same floats.
FAST_COMPILE = "--xla_backend_optimization_level=1"
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
# A fresh persistent compilation cache per test session: tests never read executables that
# other runs or other JAX builds left in ~/.cache, and the many engines the tests build (each
# jitting its own step closures) share the executables of identical programs.
# (made before pytest-xdist starts its workers, which inherit it and so share the directory)
if "MEGAJAX_TEST_JAX_CACHE" not in os.environ:
    os.environ["MEGAJAX_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="megajax-jax-cache-")
os.environ["MEGAJAX_JAX_CACHE"] = os.environ["MEGAJAX_TEST_JAX_CACHE"]
jax.config.update("jax_compilation_cache_dir", os.environ["MEGAJAX_JAX_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

GOLDEN = ROOT.parent / "shared" / "golden"


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drop each module's compiled programs (and the Mosaic GPU interpreter's state) when it
    ends: run whole in one process, the suite grew to ~11 GB and then aborted inside an XLA
    compile late in the run (every module passes alone), on a 24 GB machine without swap;
    the two test workers each run many modules."""
    from serve.programs import shared_programs

    yield
    jax.clear_caches()
    shared_programs().clear()
    interp = sys.modules.get("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    if interp is not None:
        interp.reset_gpu_interpret_mode_state()
    gc.collect()


REPORT: dict[str, str] = {}


# A fake-quantised element within float noise of a rounding boundary can round the other way
# on another CPU (XLA's vector code differs by machine) and step the logits of every later row
# by 1e-4 to 1e-2, then more through a flipped routing choice (the fixture README; on one CPU
# c37 stepped by 0.011 at row 17, then 2.1 at row 26). The fixture counts such elements per
# path; where it found some and the logits differ, the same path must match with the weights
# moved by float noise (times 1 + 1e-7 N): a flip, not a bug, moves with that noise.
NOISE_DRAWS = 4


def noisy(params, draw: int):
    """``params`` with every float weight times 1 + 1e-7 N (seeded by ``draw``)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(draw), len(leaves))
    return jax.tree.unflatten(tree, [w * (1 + 1e-7 * jax.random.normal(k, w.shape, w.dtype))
                                     if jnp.issubdtype(w.dtype, jnp.floating) else w for w, k in zip(leaves, keys)])


def agree(got: np.ndarray, ref: np.ndarray) -> bool:
    return np.abs(got - ref).max() <= 1e-3 and (got.argmax(-1) == ref.argmax(-1)).all()


class GoldenModel:
    def __init__(self, name: str):
        from checkpoints.hf import load_params
        from model.config import ModelConfig
        from model.engram_vocab import engram_map_for

        self.dir = GOLDEN / name
        self.cfg = ModelConfig.from_json(self.dir)
        self.params = load_params(self.dir, self.cfg)
        self.emap = jnp.asarray(engram_map_for(self.cfg.vocab_size, self.cfg.engram_compressed_vocab_size,
                                               self.cfg.engram_pad_id))
        self.cases = {c["name"]: c for c in json.loads((self.dir / "cases.json").read_text())["cases"]}

    def load(self, file: str) -> np.ndarray:
        return np.load(self.dir / file)

    def paths(self, case: dict) -> dict[str, tuple[list[int], str]]:
        """path name -> (call sizes, logits file)."""
        n, p = case["length"], case["decode"]["prefill"]
        out = {"full": ([n], case["full_logits"]), "decode": ([p] + [1] * (n - p), case["decode"]["logits"])}
        if "chunked" in case:
            out["chunked"] = (case["chunked"]["chunks"], case["chunked"]["logits"])
        return out

    def run(self, ids: list[int], calls: list[int], trace: bool = False, forced=None, max_len: int = 64,
            params=None):
        """Logits of the calls concatenated, plus per-call traces when asked (``params``: other
        weights of the same shapes).

        ``forced(start, n)`` gives the forced selection of the call covering rows
        ``[start, start + n)``. Prefill calls are padded to ``max_len`` tokens so all of
        them share one compilation.
        """
        from model.batch import pack_requests
        from model.forward import forward_jit
        from model.state import init_state

        state = init_state(self.cfg, 1, max_len, page_size=16)
        logits, traces, pos = [], [], 0
        for n in calls:
            batch = pack_requests([(0, ids[pos:pos + n], pos)], pad_to=max_len if n > 1 else 1)
            kw = {} if forced is None else {"forced_selection": forced(pos, batch.tokens.shape[0])}
            out = forward_jit(self.params if params is None else params, self.cfg, state, batch, self.emap,
                              trace=trace, **kw)
            logits.append(np.asarray(out[0])[:n])
            state = out[1]
            if trace:
                traces.append((pos, n, out[2]))
            pos += n
        return np.concatenate(logits), traces


@pytest.fixture
def rng(request):
    """Fresh random inputs each run; the seed is in the test's report so a failure replays."""
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def tiny():
    return GoldenModel("v41_tiny")


@pytest.fixture(scope="session")
def binding():
    return GoldenModel("v41_tiny_binding")


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("golden parity (max / median |logit diff|)")
        for key in sorted(REPORT):
            terminalreporter.write_line(f"{key}: {REPORT[key]}")


def cpu_env(devices: int) -> dict[str, str]:
    """The environment of a child process with ``devices`` CPU devices (the suite's flags kept)."""
    return {**os.environ, "XLA_FLAGS": f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
