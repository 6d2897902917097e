"""Deprecated: the names of the former lbcomm/bench/cli.py, now in lbcomm.cli."""
from ..cli.commands import main
from ..cli.schema import ALLREDUCE_ROW_FIELDS, TRAIN_ROW_FIELDS, check_allreduce_doc, check_train_doc
from ..cli.units import parse_count

__all__ = ["main", "parse_count", "check_allreduce_doc", "check_train_doc", "ALLREDUCE_ROW_FIELDS",
           "TRAIN_ROW_FIELDS"]
