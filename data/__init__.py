"""Dataset preparation (data/<name>/prepare.py) and the token shard format and loader (data/shards.py)."""
