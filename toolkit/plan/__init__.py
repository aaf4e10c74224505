"""`toolkit plan`: per-rank memory, FLOPs, communication and step time of a recipe's layout, and the ranked
layouts that fit a cluster."""

from toolkit.plan.host import offload_host_bytes
from toolkit.plan.signal import signal_note

__all__ = ["offload_host_bytes", "signal_note"]
