"""`toolkit plan`: per-rank memory, FLOPs, communication and step time of a recipe's layout, and the ranked
layouts that fit a cluster."""
