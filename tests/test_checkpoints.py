"""HF safetensors loading (single and sharded), its error paths, random init and orbax round trips."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints.hf import CheckpointError, load_params
from checkpoints.init import init_params
from checkpoints.orbax_io import restore_params, save_params
from conftest import GOLDEN
from model.config import ModelConfig
from model.params import abstract_params

TINY = GOLDEN / "v41_tiny"


@pytest.fixture(scope="module")
def tensors():
    return load_file(TINY / "model.safetensors")


def _write(tmp_path, tensors, shards=1):
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, tmp_path / "model.safetensors")
        return tmp_path
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / fname)
        weight_map.update({n: fname for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


def test_sharded_equals_single(tmp_path, tensors):
    single = load_params(TINY)
    sharded = load_params(_write(tmp_path, tensors, shards=3))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), single, sharded)
    np.testing.assert_array_equal(np.asarray(single["layers"][4]["moe"]["w1"][3]),
                                  tensors["model.layers.4.ffn.experts.3.w1.weight"])


def test_loaded_structure_matches_abstract():
    cfg = ModelConfig.from_json(TINY)
    loaded = jax.tree.map(lambda a: (a.shape, a.dtype), load_params(TINY, cfg))
    want = jax.tree.map(lambda a: (a.shape, a.dtype), abstract_params(cfg))
    assert loaded == want


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.3.attn.wq_a.weight"), "missing tensors: model.layers.3.attn.wq_a.weight"),
    (lambda t: t.update({"model.layers.3.attn.bogus": np.zeros(2, np.float32)}), "unexpected tensors"),
    (lambda t: t.update({"model.norm.weight": np.zeros(255, np.float32)}), r"model.norm.weight: shape \[255\]"),
    (lambda t: t.update({"lm_head.weight": np.zeros((512, 256), np.int32)}), "lm_head.weight: dtype I32"),
])
def test_checkpoint_errors_name_the_tensor(tmp_path, tensors, edit, message):
    t = dict(tensors)
    edit(t)
    with pytest.raises(CheckpointError, match=message):
        load_params(_write(tmp_path, t))


def test_vision_tensors_are_skipped_and_a_partial_draft_is_an_error(tmp_path, tensors, caplog):
    vision = {"vision.blocks.0.attn.wqkv.weight": np.zeros((6, 2), np.float32),
              "image_newline": np.zeros(256, np.float32)}
    with caplog.at_level("INFO", logger="megajax"):
        params = load_params(_write(tmp_path, dict(tensors, **vision)))
    assert "mtp" not in params and "skipped 2 vision tensors" in caplog.text
    t = dict(tensors, **{"mtp.0.main_proj.weight": np.zeros((256, 768), np.float32)})
    with pytest.raises(CheckpointError, match="missing tensors: mtp.0.attn_norm.weight"):
        load_params(_write(tmp_path, t))


def test_missing_shard_and_empty_dir(tmp_path, tensors):
    with pytest.raises(CheckpointError, match="no safetensors"):
        load_params(tmp_path, ModelConfig.from_json(TINY))
    d = _write(tmp_path, tensors, shards=2)
    next(d.glob("model-00002*")).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_params(d)


def test_random_init_is_deterministic_and_usable():
    cfg = ModelConfig.from_json(TINY)
    a, b, c = init_params(cfg, seed=1), init_params(cfg, seed=1), init_params(cfg, seed=2)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert not np.array_equal(np.asarray(a["layers"][2]["attn"]["wq_a"]), np.asarray(c["layers"][2]["attn"]["wq_a"]))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), a) == jax.tree.map(lambda x: (x.shape, x.dtype),
                                                                          abstract_params(cfg))
    bf16 = init_params(cfg, seed=1, dtype=jnp.bfloat16)
    assert bf16["embed"].dtype == jnp.bfloat16 and bf16["layers"][0]["hc_attn"]["fn"].dtype == jnp.float32


def test_orbax_round_trip(tmp_path):
    cfg = ModelConfig.from_json(TINY)
    params = init_params(cfg, seed=3)
    save_params(tmp_path / "ckpt", params)
    back = restore_params(tmp_path / "ckpt", cfg)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), params, back)
