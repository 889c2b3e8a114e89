"""The modeling file that ``unmask export --format hf`` ships beside the weights
(``modeling_unmask.py``). transformers loads it from the export with
``trust_remote_code=True``; unmask itself never imports it. It depends on torch and
transformers only, so it runs wherever the export is copied."""
