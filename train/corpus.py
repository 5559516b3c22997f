"""The training corpus: the Python standard library's own sources, present offline on every
machine that has Python (PSF License 2.0).

Every ``.py`` file under ``sysconfig``'s ``stdlib`` (``site-packages`` excluded, files that are
not UTF-8 skipped), in path order, tokenised with the DeepSeek-V4 tokenizer; each file is one
document, ended by the EOS token. A file is held out when the SHA-1 of its relative path falls
in the held-out fraction, so the split does not depend on the machine's file order and a file's
text is never on both sides. The corpus differs a little between Python versions: ``stats``
names the one used.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LICENCE = "PSF-2.0 (the Python Software Foundation License)"
HELD_OUT = 0.02


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # int32 token ids, documents end with EOS
    heldout: np.ndarray
    stats: dict


def source_files(root: Path | None = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts
                  and "__pycache__" not in p.relative_to(root).parts)


def held_out(relative: str, fraction: float = HELD_OUT) -> bool:
    h = int.from_bytes(hashlib.sha1(relative.encode()).digest()[:8], "little")
    return h / 2.0 ** 64 < fraction


def build(tokenizer, eos_id: int, root: Path | None = None, fraction: float = HELD_OUT,
          max_files: int | None = None) -> Corpus:
    """Tokenise the corpus (``tokenizer``: a ``tokenizers.Tokenizer``)."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    sides: dict[bool, list[str]] = {False: [], True: []}
    n_bytes, skipped = 0, 0
    for path in source_files(root)[:max_files]:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        n_bytes += len(raw)
        sides[held_out(path.relative_to(root).as_posix(), fraction)].append(text)

    def ids(texts: list[str]) -> np.ndarray:
        out = [np.asarray(e.ids + [eos_id], np.int32) for e in tokenizer.encode_batch(texts)]
        return np.concatenate(out) if out else np.zeros(0, np.int32)

    train, heldout = ids(sides[False]), ids(sides[True])
    stats = {"name": f"CPython {platform.python_version()} standard library sources", "licence": LICENCE,
             "root": str(root), "files": len(sides[False]) + len(sides[True]), "heldout_files": len(sides[True]),
             "skipped_not_utf8": skipped, "bytes": n_bytes, "train_tokens": int(train.size),
             "heldout_tokens": int(heldout.size)}
    return Corpus(train, heldout, stats)
