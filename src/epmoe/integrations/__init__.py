"""What epmoe knows about the models it runs: transformers' experts modules and the blocks around
them. :mod:`~epmoe.integrations.experts` recognises experts modules (packed v5 experts, Linear-triple
``nn.ModuleList`` experts, transformers' default gate, what the fused ops can run);
:mod:`~epmoe.integrations.blocks` the blocks (routers, shared experts) and the forwards epmoe puts
in place of theirs. The engine (:mod:`epmoe.ep`, :mod:`epmoe.experts`) reads models only through
these."""
