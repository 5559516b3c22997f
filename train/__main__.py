"""``python -m train {target,draft,export,card} --run DIR``: the small V4.1 and its DSpark draft.

Each stage resumes from the run's orbax checkpoints (``DIR/target``, ``DIR/draft``) and stops at
its schedule's last step or after ``--minutes`` (a device call is bounded), so a few calls
finish it. The corpus is tokenised once into ``DIR/corpus.npz``. ``export`` writes the trained
model with its draft as a checkpoint in the release's V4.1 format; ``card`` measures that
checkpoint as served and writes its model card beside it (``train/card.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
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
    np.savez_compressed(path, train=c.train, heldout=c.heldout, stats=json.dumps(c.stats))
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


def _train(stage_dir: Path, trainable: dict, loss, data, schedule, minutes: float | None, steps_given: bool,
           meta: dict, frozen: dict | None = None):
    """Resume the stage with the schedule it started with; a fresh stage given ``minutes`` (and
    no ``--steps``) first times ``PROBE_STEPS`` steps and cuts its length to what fits (the
    warm-up's rates do not depend on the length, so the probe's steps stand)."""
    from train import loop

    if (saved := loop.saved_schedule(stage_dir)) is not None and loop.has_checkpoint(stage_dir):
        schedule = dataclasses.replace(saved, steps=schedule.steps) if steps_given else saved
    elif minutes is not None and not steps_given:
        t0 = time.perf_counter()
        probe = dataclasses.replace(schedule, steps=recipe.PROBE_STEPS, log_every=1)
        trainable, _ = loop.run(stage_dir, trainable, loss, data, probe, frozen=frozen, meta=meta)
        log = loop.read_log(stage_dir)
        per_step = (log[-1]["seconds"] - log[4]["seconds"]) / (len(log) - 5)
        minutes -= (time.perf_counter() - t0) / 60
        fits = recipe.PROBE_STEPS + int(minutes * 60 * 0.95 / per_step)
        schedule = dataclasses.replace(schedule, steps=min(schedule.steps, fits))
        print(f"{stage_dir.name}: {per_step * 1e3:.0f} ms a step, {schedule.steps} steps fit", flush=True)
    loop.run(stage_dir, trainable, loss, data, schedule, frozen=frozen, minutes=minutes, meta=meta)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["target", "draft", "export", "card"])
    ap.add_argument("--run", required=True, type=Path, help="the run directory")
    ap.add_argument("--steps", type=int, help="override the stage's schedule length")
    ap.add_argument("--minutes", type=float, help="fit a fresh stage to this long, and stop (with a checkpoint) "
                                                   "after it")
    ap.add_argument("--batch", type=int, default=recipe.BATCH)
    ap.add_argument("--seq-len", type=int, default=recipe.SEQ_LEN)
    ap.add_argument("--max-files", type=int, help="a corpus of the first N files (smoke runs)")
    ap.add_argument("--out", type=Path, help="export: the checkpoint directory to write")
    ap.add_argument("--model", type=Path, help="card: the exported checkpoint directory (the card goes beside it)")
    ap.add_argument("--max-heldout-tokens", type=int, help="card: score only the first N held-out tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.stage == "export" and args.out is None:
        ap.error("export needs --out")
    if args.stage == "card" and args.model is None:
        ap.error("card needs --model")
    import jax

    from train import draft, loop, target
    from train.data import batches

    # the probe and the stage's run compile the same step: the second is a cache hit
    jax.config.update("jax_compilation_cache_dir", str(args.run.absolute() / "xla_cache"))
    cfg = recipe.small_config()
    train_ids, heldout_ids, stats = corpus(args.run, args.max_files)
    if args.stage == "card":
        from train.card import write

        write(args.run, args.model, stats, train_ids, heldout_ids, args.max_heldout_tokens)
        print(f"wrote {args.model / 'MODEL_CARD.md'}")
        return 0
    emap = _engram_map(cfg)
    backbone, mtp = _initial(cfg, args.seed)
    t_sched, d_sched = (recipe.TARGET, recipe.DRAFT) if args.steps is None else \
        (dataclasses.replace(recipe.TARGET, steps=args.steps), dataclasses.replace(recipe.DRAFT, steps=args.steps))
    meta = {"corpus": stats, "batch": args.batch, "seq_len": args.seq_len, "config": cfg.to_dict()}
    if args.stage in ("target", "draft"):
        data = batches(train_ids, args.seq_len, args.batch, args.seed)
    if args.stage == "target":
        _train(args.run / "target", backbone, target.loss_fn(cfg, emap), data, t_sched, args.minutes,
               args.steps is not None, meta)
        return 0
    backbone, _ = loop.restore(args.run / "target", backbone, t_sched)
    if args.stage == "draft":
        b = cfg.dspark_block_size
        anchored = data.random_map(lambda t, rng: draft.anchored(t, recipe.DRAFT_ANCHORS, b, rng),
                                   seed=args.seed + 1)
        _train(args.run / "draft", mtp, draft.loss_fn(cfg, emap), anchored, d_sched, args.minutes,
               args.steps is not None, meta, frozen=backbone)
        return 0
    from checkpoints.export import save_checkpoint

    mtp, _ = loop.restore(args.run / "draft", mtp, d_sched)
    save_checkpoint({**backbone, "mtp": mtp}, cfg, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
