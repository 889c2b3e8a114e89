"""Text generation from an export, and the quality of what it generates (generative perplexity, the
sampler sweep). See docs/sampling.md.
"""
