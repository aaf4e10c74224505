"""Training data. `text`: raw files or a hub dataset tokenized on the fly; `stream`: the per-rank, resumable
micro-batch stream every backend reads."""
from toolkit.data.stream import DataStream, check_fills_a_step
from toolkit.data.text import build_dataset, check_files

__all__ = ["DataStream", "build_dataset", "check_files", "check_fills_a_step"]
