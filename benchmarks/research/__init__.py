"""Research harnesses: measurements of designs the product does not implement (four-bit KV
schemes), outside ``make bench`` and ``make test``."""
