"""Tokenizers behind one interface: SentencePiece (loaded or trained), GPT-2's BPE, any Hugging Face
``tokenizer.json``; ``load`` finds the kind a path holds."""
