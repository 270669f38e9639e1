"""Recommendation models exported from PyTorch and the scripts that made them (they alone need torch).

- fm.onnx (export_fm.py): a factorization machine, 10 fields x 1000 ids, 16 factors.
- dlrm.onnx (export_dlrm.py): a DLRM-style model, 13 dense features and 26 categorical fields, for the
  synthetic Criteo-like Parquet data criteo_synthetic.py writes.
"""

from pathlib import Path

#: The shipped factorization machine: 10 fields x 1000 ids, 16 factors (export_fm.py's defaults).
FM_PATH = Path(__file__).resolve().parent / "fm.onnx"
#: torch autograd's loss and gradients of fm.onnx on one batch (written beside it by export_fm.py).
FM_REFERENCE_PATH = FM_PATH.with_suffix(".npz")
#: The shipped DLRM-style example (export_dlrm.py's defaults; docs/models.md, "DLRM example").
DLRM_PATH = Path(__file__).resolve().parent / "dlrm.onnx"
#: torch's float64 logits, loss and gradients of dlrm.onnx on one batch (written beside it by export_dlrm.py).
DLRM_REFERENCE_PATH = DLRM_PATH.with_suffix(".npz")
