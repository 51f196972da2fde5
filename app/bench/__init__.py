"""The `kvforge bench` commands, one module per verb (latency, throughput, serve, chat, quant, kv_quant, spec,
structured, defaults, gpu, peers, clients, kernels, profile, vision), and the pieces they share: arguments (checks
before anything loads), workloads (prompt sets), runs (driving a kvforge engine), references (HF transformers runs and
the parity rule), probe (the device), random_models (the GPU bench's models), report (percentiles, tables, verdicts)
and the peers bench's parts (peer_engines, peers_http, peers_report, peer_worker; real_shapes: random-weight GGUFs and
safetensors twins of real models' shapes; roofline: the CPU, its streaming bandwidth, a decode's bytes); the vision
bench's: vision_worker, vision_shapes, hf_to_gguf (an HF model as llama.cpp's converter writes it)."""

from __future__ import annotations

import argparse


def add_parsers(bench_sub: argparse._SubParsersAction) -> None:
    """Register every bench verb on the `kvforge bench` subcommands, in the order `--help` lists them."""
    from kvforge.app.bench import (
        chat,
        clients,
        defaults,
        gpu,
        kernels,
        kv_quant,
        latency,
        peers,
        profile,
        quant,
        serve,
        spec,
        structured,
        throughput,
        vision,
    )

    for verb in (latency, throughput, serve, chat, quant, kv_quant, spec, structured, defaults, gpu, peers, clients,
                 kernels, profile, vision):
        verb.add_parser(bench_sub)
