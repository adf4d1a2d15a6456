"""Dataset preparation: data/<name>/prepare.py (the token shard format and its loader are gpt/shards.py)."""
