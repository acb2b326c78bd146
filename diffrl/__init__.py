"""diffrl: RL post-training of diffusion and flow-matching image models."""

__version__ = "0.1.0"
