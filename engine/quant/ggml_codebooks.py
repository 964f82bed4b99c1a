"""The ggml codebooks that quant/gguf.py's reference decoders and kernels/gguf_matmul.py's Triton kernel both read
(ggml-common.h's kvalues_iq4nl and kvalues_mxfp4), in a module of their own so neither imports the other."""

IQ4 = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL / IQ4_XS
FP4X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # MXFP4's E2M1 values x 2
