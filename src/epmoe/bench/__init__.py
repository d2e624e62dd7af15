"""Benchmarks behind ``epmoe bench <name>``: one module per benchmark, shared helpers in ``common``.

    epmoe bench gmm     epmoe.bench.gmm      grouped matmul per backend and ``auto`` vs one dense matmul
    epmoe bench layer   epmoe.bench.layer    an MoE block vs transformers' experts; EP vs transformers' EP
    epmoe bench fused   epmoe.bench.fused    fused vs unfused dispatch / combine on several ranks

A benchmark module exposes ``add_arguments(parser)`` (its own options) and ``run(args) -> int``;
:mod:`epmoe.cli.bench` turns every such module named in its ``BENCHMARKS`` into a subcommand and
adds the options all benchmarks share (:func:`epmoe.bench.common.add_common_arguments`).
"""
