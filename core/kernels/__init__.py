"""Triton kernels for the GPU fast path (paged attention, fused norm / activation / rotary / KV store).

They run compiled on CUDA tensors, and interpreted on CPU tensors under `TRITON_INTERPRET=1`, which is
how the CPU test suite checks each of them against a torch reference (see runtime.py).
"""
