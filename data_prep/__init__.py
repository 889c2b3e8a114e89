"""Data preparation: corpus readers, tokenizers, the Ray tokenize/pack pipeline, the shard
format (writer and streaming reader) and the manifest."""
