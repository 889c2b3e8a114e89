"""The shard format and its manifest, the streaming loader that reads it, and where shards are read
from (a local directory or object storage)."""
