"""Data preparation: corpus readers, tokenizers (loaded, or trained on the corpus), the Ray
tokenize/pack pipeline (``data_prep.write_shards``) and prep as one call (``data_prep.prep``),
the shard format (writer and streaming reader) and the manifest."""
