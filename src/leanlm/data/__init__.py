"""Shipped data sets (evaluation and calibration), verified against their checksums."""

from leanlm.data.calibration import calibration_batches
from leanlm.data.datasets import (
    arc_items,
    hellaswag_items,
    lambada_test_texts,
    piqa_items,
    plain_text,
    ptb_text,
    wikitext2_test_text,
    winogrande_items,
)
from leanlm.data.files import data_root, verified_path

__all__ = [
    "calibration_batches",
    "arc_items",
    "hellaswag_items",
    "lambada_test_texts",
    "piqa_items",
    "plain_text",
    "ptb_text",
    "wikitext2_test_text",
    "winogrande_items",
    "data_root",
    "verified_path",
]
