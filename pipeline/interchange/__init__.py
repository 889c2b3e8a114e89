"""Models in and out: unmask exports, the Hugging Face format, and the imports of MDLM's and BD3-LM's
checkpoints."""
