"""One training loop for both stages: AdamW (optax) on the trainable subtree, a jitted step,
resumable from orbax checkpoints.

A run directory holds ``ckpt/`` (orbax ``CheckpointManager``: the trainable parameters and the
optimiser state, by step) and ``log.jsonl`` (one line per logged step: loss, learning rate,
tokens seen, seconds). ``run`` restores the latest step when there is one and reads the data
from that step on (``train.data`` batches are indexed by step), stops at ``steps`` or when
``minutes`` have passed (a device call is bounded), and checkpoints when it stops.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclass(frozen=True)
class Schedule:
    steps: int
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    log_every: int = 20
    ckpt_every: int = 500

    def learning_rate(self, step: int) -> float:
        return float(optax.warmup_cosine_decay_schedule(0.0, self.lr, max(self.warmup, 1),
                                                        max(self.steps, self.warmup + 1), self.lr * 0.1)(step))

    def optimizer(self) -> optax.GradientTransformation:
        """AdamW whose learning rate is state set each step (``learning_rate``), not a constant:
        the step's program then does not depend on the schedule's length, so a probe's compile
        serves the run after it."""
        def make(learning_rate):
            return optax.chain(optax.clip_by_global_norm(self.clip),
                               optax.adamw(learning_rate, b2=0.95, weight_decay=self.weight_decay))

        return optax.inject_hyperparams(make)(learning_rate=0.0)


# loss(trainable, frozen, batch) -> (scalar loss, dict of scalar metrics); a batch is a pytree
# whose first leaf is the int32 tokens [B, L + 1]
Loss = Callable[[dict, jnp.ndarray], tuple[jnp.ndarray, dict]]


def _manager(run_dir: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(run_dir.absolute() / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2))


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def restore(run_dir: str | Path, trainable: dict, schedule: Schedule) -> tuple[dict, int]:
    """The latest checkpoint's trainable parameters (``trainable``: a tree like them) and step."""
    import orbax.checkpoint as ocp

    with _manager(Path(run_dir)) as manager:
        if (last := manager.latest_step()) is None:
            raise FileNotFoundError(f"{run_dir} has no checkpoint")
        like = {"params": trainable, "opt": jax.eval_shape(schedule.optimizer().init, trainable)}
        return manager.restore(last, args=ocp.args.StandardRestore(_abstract(like)))["params"], last


def run(run_dir: str | Path, trainable: dict, loss: Loss, data, schedule: Schedule, frozen: dict | None = None,
        minutes: float | None = None, meta: dict | None = None) -> tuple[dict, int]:
    """Train ``trainable`` (``frozen``: the parameters it is trained beside) on ``data[step]``
    batches; ``(trainable, step reached)``."""
    import orbax.checkpoint as ocp

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    opt = schedule.optimizer()
    opt_state = opt.init(trainable)
    step = 0
    with _manager(run_dir) as manager:
        if (last := manager.latest_step()) is not None:
            tree = manager.restore(last, args=ocp.args.StandardRestore(_abstract({"params": trainable,
                                                                                  "opt": opt_state})))
            trainable, opt_state, step = tree["params"], tree["opt"], last
        (run_dir / "schedule.json").write_text(json.dumps({**asdict(schedule), **(meta or {})}, indent=1))

        @jax.jit
        def train_step(p, s, fixed, batch, lr):   # `fixed` an argument, not a constant baked into the program
            s.hyperparams["learning_rate"] = lr
            (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(p, fixed, batch)
            updates, s = opt.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value, metrics

        t0, start = time.perf_counter(), step
        with open(run_dir / "log.jsonl", "a") as log:
            while step < schedule.steps:
                batch = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.int32)), data[step])
                trainable, opt_state, value, metrics = train_step(trainable, opt_state, frozen, batch,
                                                                 jnp.float32(schedule.learning_rate(step)))
                step += 1
                if step % schedule.log_every == 0 or step == schedule.steps:
                    tokens = jax.tree.leaves(batch)[0]
                    row = {"step": step, "loss": float(value), "tokens": step * tokens.shape[0] * (tokens.shape[1] - 1),
                           "seconds": time.perf_counter() - t0, "lr": schedule.learning_rate(step - 1), **{k: float(v) for k, v in metrics.items()}}
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                out_of_time = minutes is not None and time.perf_counter() - t0 > minutes * 60
                if step % schedule.ckpt_every == 0 or step == schedule.steps or out_of_time:
                    manager.save(step, args=ocp.args.StandardSave({"params": trainable, "opt": opt_state}))
                if out_of_time:
                    break
        manager.wait_until_finished()
    print(f"{run_dir.name}: steps {start} -> {step} of {schedule.steps} in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return trainable, step


def saved_schedule(run_dir: str | Path) -> Schedule | None:
    """The schedule a run was started with (a resumed run keeps its length and rates)."""
    path = Path(run_dir) / "schedule.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return Schedule(**{f: saved[f] for f in Schedule.__dataclass_fields__})


def has_checkpoint(run_dir: str | Path) -> bool:
    with _manager(Path(run_dir)) as manager:
        return manager.latest_step() is not None


def read_log(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
