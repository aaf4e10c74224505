"""`toolkit plan`: per-rank memory, FLOPs, communication and step time of a recipe's layout, and the ranked
layouts that fit a cluster."""

from toolkit.plan.signal import signal_note

__all__ = ["signal_note"]
