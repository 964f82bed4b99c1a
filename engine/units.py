"""Byte and rate units, defined once for every room (it imports nothing): binary sizes for memory and files, decimal
GB for bandwidths (GB/s) as spec sheets and `fit` state them."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
