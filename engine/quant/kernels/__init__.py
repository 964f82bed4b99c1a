"""Triton kernels that compute with packed experts straight from the slot buffers (CUDA; the Triton
interpreter runs them on CPU tensors in the tests). Importing a kernel module imports triton: formats
import them lazily, when a CUDA tensor first needs one.
"""
