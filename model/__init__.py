"""Masked diffusion math and networks: schedules, the diffusion process and its bounds,
the sampler, the transformer denoiser and the autoregressive baseline. No I/O, no
distributed code."""
