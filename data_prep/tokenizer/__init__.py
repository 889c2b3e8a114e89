"""Tokenizers behind one interface (``base.Tokenizer``): SentencePiece (``sentencepiece_model``:
a trained model, and the trainer that takes texts), GPT-2's BPE (``gpt2_bpe``) and any Hugging
Face ``tokenizer.json`` (``hugging_face``). ``load.load_tokenizer`` finds the kind a path holds;
``training`` trains a SentencePiece tokenizer on a corpus as the readers read it (``unmask
tokenizer train``, and the tokenizer ``unmask prep --vocab-size`` trains). The manual:
docs/data-preparation.md, "Tokenizers"."""
