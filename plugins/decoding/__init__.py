"""Speculative-decoding plugins, registered through the `kvforge.decoding` entry-point group."""
