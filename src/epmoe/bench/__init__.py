"""Benchmarks behind ``epmoe bench <name>``: one module per benchmark, shared helpers in ``common``.

    epmoe bench gmm         epmoe.bench.gmm         grouped matmul per backend and ``auto`` vs one dense matmul
    epmoe bench layer       epmoe.bench.layer       an MoE block vs transformers' experts; EP vs transformers' EP
    epmoe bench fused       epmoe.bench.fused       fused vs unfused dispatch / combine on several ranks
    epmoe bench checkpoint  epmoe.bench.checkpoint  peak memory per rank of building, loading and saving an EP model
    epmoe bench versus      epmoe.bench.versus      epmoe vs transformers' own expert parallelism, side by side
    epmoe bench experts     epmoe.bench.experts     experts_implementation="epmoe"'s activation memory vs grouped_mm

What the library does not ship (one-off measurements, each with the table it wrote) lives in the
repository's ``benchmarks/``, beside every committed table.

A benchmark module exposes ``add_arguments(parser)`` (its own options) and ``run(args) -> int``;
:mod:`epmoe.cli.bench` turns every such module named in its ``BENCHMARKS`` into a subcommand and
adds the options all benchmarks share (:func:`epmoe.bench.common.add_common_arguments`).
"""
