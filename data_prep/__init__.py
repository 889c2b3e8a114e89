"""Data preparation: corpus readers, tokenizers (loaded, or trained on the corpus), the Ray
tokenize/pack pipeline and prep as one call (``data_prep.prepare``), the shard format (writer
and streaming reader) and the manifest."""
