"""Command-line options the CLIs share, defined once."""
from __future__ import annotations

import argparse


def add_dtype(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="the model dtype of weights and activations (auto: bfloat16 on a GPU, where the Pallas "
                         "kernels take it, float32 elsewhere); a checkpoint's quantised experts stay quantised")
