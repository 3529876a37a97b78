"""Ragged attention: one forward pass over many sequences of different lengths, no padding
between them. ``step`` routes a step's rows to the group caches that own them and installs
the hook in a model; ``dense`` attends float keys, ``quantized`` and ``eight_bit`` quantized
ones, reading their words (``words``).

This package imports nothing; import from its modules."""
