"""Recommendation models exported from PyTorch (fm.onnx) and the script that made them (export_fm.py, needs torch)."""

from pathlib import Path

#: The shipped factorization machine: 10 fields x 1000 ids, 16 factors (export_fm.py's defaults).
FM_PATH = Path(__file__).resolve().parent / "fm.onnx"
#: torch autograd's loss and gradients of fm.onnx on one batch (written beside it by export_fm.py).
FM_REFERENCE_PATH = FM_PATH.with_suffix(".npz")
