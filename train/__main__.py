"""``python -m train {target,draft,export} --run DIR``: the small V4.1 and its DSpark draft.

Each stage resumes from the run's orbax checkpoints (``DIR/target``, ``DIR/draft``) and stops at
its schedule's last step or after ``--minutes`` (a device call is bounded), so a few calls
finish it. The corpus is tokenised once into ``DIR/corpus.npz``. ``export`` writes the trained
model with its draft as a checkpoint in the release's V4.1 format.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from train import recipe


def corpus(run: Path, max_files: int | None):
    path = run / "corpus.npz"
    if path.exists():
        z = np.load(path)
        return z["train"], z["heldout"], json.loads(str(z["stats"]))
    from tokenizers import Tokenizer

    from model.engram_vocab import tokenizer_path
    from train.corpus import build

    cfg = recipe.small_config()
    c = build(Tokenizer.from_file(str(tokenizer_path())), cfg.eos_token_id, max_files=max_files)
    run.mkdir(parents=True, exist_ok=True)
    np.savez(path, train=c.train, heldout=c.heldout, stats=json.dumps(c.stats))
    print(json.dumps(c.stats), flush=True)
    return c.train, c.heldout, c.stats


def _engram_map(cfg):
    import jax.numpy as jnp

    from model.engram_vocab import engram_map_for

    return jnp.asarray(engram_map_for(cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id))


def _initial(cfg, seed: int):
    from checkpoints.init import init_params

    params = init_params(cfg, seed=seed, draft=True)
    mtp = params.pop("mtp")
    return params, mtp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["target", "draft", "export"])
    ap.add_argument("--run", required=True, type=Path, help="the run directory")
    ap.add_argument("--steps", type=int, help="override the stage's schedule length")
    ap.add_argument("--minutes", type=float, help="stop (with a checkpoint) after this long")
    ap.add_argument("--batch", type=int, default=recipe.BATCH)
    ap.add_argument("--seq-len", type=int, default=recipe.SEQ_LEN)
    ap.add_argument("--max-files", type=int, help="a corpus of the first N files (smoke runs)")
    ap.add_argument("--out", type=Path, help="export: the checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.stage == "export" and args.out is None:
        ap.error("export needs --out")
    from train import draft, loop, target
    from train.data import batches

    cfg = recipe.small_config()
    train_ids, _, stats = corpus(args.run, args.max_files)
    emap = _engram_map(cfg)
    backbone, mtp = _initial(cfg, args.seed)
    t_sched = recipe.TARGET if args.steps is None or args.stage != "target" else \
        dataclasses.replace(recipe.TARGET, steps=args.steps)
    d_sched = recipe.DRAFT if args.steps is None or args.stage != "draft" else \
        dataclasses.replace(recipe.DRAFT, steps=args.steps)
    meta = {"corpus": stats, "batch": args.batch, "seq_len": args.seq_len, "config": cfg.to_dict()}
    if args.stage != "export":
        data = batches(train_ids, args.seq_len, args.batch, args.seed)
    if args.stage == "target":
        loop.run(args.run / "target", backbone, target.loss_fn(cfg, emap), data, t_sched, minutes=args.minutes,
                 meta=meta)
        return 0
    backbone, _ = loop.restore(args.run / "target", backbone, t_sched)
    if args.stage == "draft":
        b = cfg.dspark_block_size
        anchored = data.random_map(lambda t, rng: draft.anchored(t, recipe.DRAFT_ANCHORS, b, rng),
                                   seed=args.seed + 1)
        loop.run(args.run / "draft", mtp, draft.loss_fn(cfg, emap), anchored, d_sched, frozen=backbone,
                 minutes=args.minutes, meta=meta)
        return 0
    from checkpoints.export import save_checkpoint

    mtp, _ = loop.restore(args.run / "draft", mtp, d_sched)
    save_checkpoint({**backbone, "mtp": mtp}, cfg, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
