"""Building blocks of the forward: attention over a paged cache, RoPE, norms."""
