"""EAGLE-3 drafter pipeline: conversations -> token shards -> hidden-state stores -> drafter -> report."""

__version__ = "0.1.0"
