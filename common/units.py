"""Units every package shares: nats per bit and the binary byte multiples."""

import math

__all__ = ["GIB", "MIB", "NATS_PER_BIT"]

NATS_PER_BIT = math.log(2.0)  # bits = nats / NATS_PER_BIT (docs/math.md, "Reporting")
MIB = 1 << 20
GIB = 1 << 30
