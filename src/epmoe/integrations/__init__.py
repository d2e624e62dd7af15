"""What epmoe knows about the models it runs: transformers' experts modules and the blocks around
them. :mod:`~epmoe.integrations.experts` recognises experts modules (packed v5 experts, Linear-triple
``nn.ModuleList`` experts, transformers' default gate, what the fused ops can run);
:mod:`~epmoe.integrations.blocks` the blocks (routers, shared experts) and the forwards epmoe puts
in place of theirs (these call back into the engine's routed path, :mod:`epmoe.ep.layer`). The
engine's model-specific knowledge lives here."""
