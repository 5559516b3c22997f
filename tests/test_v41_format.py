"""The released V4.1 checkpoint format: export, load, byte layout, and the errors of bad checkpoints.

The exporter writes a param tree as the release stores it (checkpoints/formats.py); loading that
directory must give exactly the in-memory quantised model (``stored_params``), logits included.
The byte layout is checked here independently of the code that writes it: headers parsed as
JSON, e4m3 decoded with ml_dtypes, nibbles and UE8M0 exponents by hand.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints.export import save_checkpoint, save_random_checkpoint, stored_params, stored_tensors
from checkpoints.formats import BF16, V41, CheckpointError
from checkpoints.hf import load_params
from checkpoints.init import init_params
from checkpoints.safetensors_io import write_shards
from conftest import GOLDEN
from model.config import ModelConfig
from model.engram_vocab import engram_map_for
from model.scoring import last_logits
from pallas_kernels.block_scaled import E2M1, Fp4Weight
from serve import generate

TINY = GOLDEN / "v41_tiny"
RELEASE_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                 "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


@pytest.fixture(scope="module")
def tiny():
    raw = json.loads((TINY / "config.json").read_text())
    # one small draft layer, so that the mtp.* tensors are written and read too
    cfg = ModelConfig.from_dict({**raw, "compress_ratios": raw["compress_ratios"][:9], "num_nextn_predict_layers": 1,
                                 "dspark_n_routed_experts": 4, "dspark_markov_rank": 16})
    return cfg, init_params(cfg, seed=5, draft=True)


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
    cfg, params = tiny
    d = tmp_path_factory.mktemp("v41")
    save_checkpoint(params, cfg, d, V41, max_shard_bytes=2 << 20)
    return d


def _header(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            out.update({k: (v, f) for k, v in json.loads(fh.read(n)).items() if k != "__metadata__"})
    return out


def _raw(d, name):
    meta, f = _header(d)[name]
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        fh.seek(8 + n + meta["data_offsets"][0])
        return np.frombuffer(fh.read(meta["data_offsets"][1] - meta["data_offsets"][0]), np.uint8)


def test_the_export_is_the_release_layout(exported, tiny):
    cfg, params = tiny
    config = json.loads((exported / "config.json").read_text())
    assert config["quantization_config"] == RELEASE_QUANT
    assert (exported / "model.safetensors.index.json").exists() and len(list(exported.glob("*.safetensors"))) > 1
    h = {k: (v["dtype"], v["shape"]) for k, (v, _) in _header(exported).items()}
    assert h["layers.0.attn.wq_a.weight"] == ("F8_E4M3", [64, 256])
    assert h["layers.0.attn.wq_a.scale"] == ("F8_E8M0", [2, 8])          # one per 32 x 32 block
    assert h["layers.3.ffn.experts.5.w2.weight"] == ("I8", [256, 32])    # two e2m1 codes a byte
    assert h["layers.3.ffn.experts.5.w2.scale"] == ("F8_E8M0", [256, 2])  # one per 32 inputs
    assert h["layers.3.ffn.shared_experts.w1.weight"][0] == "F8_E4M3"
    assert h["layers.1.engram.embed.weight"] == ("F8_E4M3", [240, 32])
    assert h["layers.1.engram.embed.scale"] == ("F8_E8M0", [240, 1])
    assert h["layers.1.engram.wkv.weight"][0] == "F8_E4M3"
    assert h["layers.2.attn.compressor.wkv.weight"][0] == "BF16" and h["layers.2.ffn.gate.weight"][0] == "BF16"
    assert h["layers.2.hc_attn_fn"][0] == h["layers.2.attn.attn_sink"][0] == h["layers.2.ffn.gate.bias"][0] == "F32"
    assert h["embed.weight"] == ("BF16", [512, 256]) and h["head.weight"][0] == "BF16"
    assert h["mtp.0.main_proj.weight"] == ("F8_E4M3", [256, 768]) and h["mtp.0.ffn.experts.3.w1.weight"][0] == "I8"
    assert h["mtp.0.markov_head.embed.weight"] == ("BF16", [512, 16])
    assert h["mtp.0.confidence_head.proj.weight"] == ("BF16", [1, 272])
    assert not any(k.startswith("model.") for k in h)


def test_bytes_decode_by_hand(exported, tiny):
    """Nibble order, e2m1 codes, UE8M0 exponents and e4m3 block scales, decoded with numpy alone."""
    cfg, params = tiny
    loaded = load_params(exported)
    packed = _raw(exported, "layers.3.ffn.experts.5.w2.weight").reshape(256, 32)
    exps = _raw(exported, "layers.3.ffn.experts.5.w2.scale").reshape(256, 2).astype(np.int32)
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(256, 64)   # even column in the low nibble
    values = np.where(codes & 8, -1, 1) * E2M1[codes & 7] * np.repeat(2.0 ** (exps - 127), 32, axis=1)
    np.testing.assert_array_equal(values, np.asarray(loaded["layers"][3]["moe"]["w2"].dequantized()[5]))
    w = np.asarray(params["layers"][3]["moe"]["w2"][5])
    assert np.abs(values - w).max() <= np.abs(w).max() / 4   # e2m1: a quarter of the block's amax at most
    q = _raw(exported, "layers.0.attn.wq_a.weight").view(ml_dtypes.float8_e4m3fn).reshape(64, 256)
    s = _raw(exported, "layers.0.attn.wq_a.scale").reshape(2, 8).astype(np.int32)
    deq = q.astype(np.float32) * np.kron(2.0 ** (s - 127), np.ones((32, 32)))
    np.testing.assert_array_equal(deq, np.asarray(loaded["layers"][0]["attn"]["wq_a"]))
    w = np.asarray(params["layers"][0]["attn"]["wq_a"])
    assert np.abs(deq - w).max() <= np.abs(w).max() / 16   # e4m3: 3 mantissa bits


def test_load_equals_the_in_memory_quantised_model(exported, tiny):
    cfg, params = tiny
    loaded = load_params(exported)
    want = stored_params(params, cfg, V41)
    assert jax.tree.structure(loaded) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded, want)
    moe = loaded["layers"][0]["moe"]
    assert isinstance(moe["w1"], Fp4Weight) and moe["w1"].shape == (8, 64, 256)   # the kernels' form, stacked
    assert moe["shared"]["w1"].dtype == jnp.float32          # fp8 32 x 32: dequantised to the model dtype
    assert loaded["layers"][1]["engram"]["table"].dtype == jnp.float8_e4m3fn
    assert loaded["layers"][1]["engram"]["scale"].dtype == jnp.uint8
    assert isinstance(loaded["mtp"]["layers"][0]["moe"]["w1"], Fp4Weight) and "main_proj" in loaded["mtp"]
    tokens = jnp.asarray([[3, 17, 99, 200, 41, 7, 300, 12]], jnp.int32)
    lengths = jnp.asarray([8], jnp.int32)
    emap = jnp.asarray(engram_map_for(cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id))
    logits = jax.jit(last_logits, static_argnums=1)
    got = np.asarray(logits(loaded, cfg, tokens, lengths, emap))
    np.testing.assert_array_equal(got, np.asarray(logits(want, cfg, tokens, lengths, emap)))
    exact = np.asarray(logits(params, cfg, tokens, lengths, emap))
    assert 0 < np.abs(got - exact).max() < 0.5 * np.abs(exact).max()   # quantised, and still the same model


def test_bf16_export_round_trips(tiny, tmp_path):
    cfg, params = tiny
    save_checkpoint(params, cfg, tmp_path, BF16)
    loaded = load_params(tmp_path, dtype=jnp.bfloat16)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert loaded["layers"][2]["attn"]["wq_a"].dtype == jnp.bfloat16
    assert loaded["layers"][2]["hc_attn"]["fn"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(loaded["layers"][2]["attn"]["wq_a"]),
                                  np.asarray(params["layers"][2]["attn"]["wq_a"].astype(jnp.bfloat16)))


def test_a_random_checkpoint_drawn_as_written_is_the_exported_init(exported, tiny, tmp_path):
    """The benchmarks' models too large for memory: drawn leaf by leaf, the same bytes as the
    export of ``init_params``."""
    cfg, _ = tiny
    save_random_checkpoint(cfg, tmp_path, V41, seed=5, draft=True, max_shard_bytes=2 << 20)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((exported / "config.json").read_text())
    names = _header(exported)
    assert set(_header(tmp_path)) == set(names) and any(n.startswith("mtp.") for n in names)
    for name in names:
        np.testing.assert_array_equal(_raw(tmp_path, name), _raw(exported, name), err_msg=name)


def _bad(tmp_path, tiny, edit=None, quant=RELEASE_QUANT):
    cfg, params = tiny
    tensors = {name: (a, raw) for name, a, raw in stored_tensors(params, cfg, V41)}
    if edit:
        edit(tensors)
    write_shards(tmp_path, [(n, a, raw) for n, (a, raw) in tensors.items()])
    config = cfg.to_dict() | ({"quantization_config": quant} if quant is not None else {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("edit, quant, message", [
    (lambda t: t.update({"layers.0.attn.wq_a.scale": (np.zeros((3, 8), np.uint8), "F8_E8M0")}), RELEASE_QUANT,
     r"layers.0.attn.wq_a.scale: F8_E8M0 \[3, 8\] does not match its weight layers.0.attn.wq_a.weight"),
    (lambda t: t.pop("layers.0.attn.wo_b.scale"), RELEASE_QUANT, "its scale tensor layers.0.attn.wo_b.scale is missing"),
    (lambda t: t.update({"layers.2.ffn.experts.1.w1.weight": (np.zeros((64, 100), np.uint8), "I8")}), RELEASE_QUANT,
     r"layers.2.ffn.experts.1.w1.weight: packed MXFP4 tensor of shape \[64, 100\]"),
    (None, {"quant_method": "awq", "weight_block_size": [32, 32]}, "quantization_config.quant_method: 'awq'"),
    (None, {**RELEASE_QUANT, "group_size": 64}, "quantization_config.group_size: unknown key"),
    (None, {**RELEASE_QUANT, "expert_dtype": "int4"}, "quantization_config.expert_dtype: 'int4'"),
    (None, None, "layers.0.attn.wq_a.weight: dtype F8_E4M3 with a scale tensor is not supported .*no quantization"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, tiny, edit, quant, message):
    d = _bad(tmp_path, tiny, edit, quant)
    with pytest.raises(CheckpointError, match=message):
        load_params(d)


def test_cli_exits_nonzero_naming_the_tensor(tmp_path, tiny, capsys):
    d = _bad(tmp_path / "ckpt", tiny, lambda t: t.pop("layers.0.attn.wo_b.scale"))
    (tmp_path / "in.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    assert generate.main(["--model", str(d), "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(tmp_path / "out.jsonl")]) == 2
    assert "layers.0.attn.wo_b.scale is missing" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
