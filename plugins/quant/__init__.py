"""Quantization plugins, each registered through the `kvforge.quant` entry-point group."""
