"""What epmoe knows about the models it runs, on top of the engine (:mod:`epmoe.ep`):

* :mod:`~epmoe.integrations.blocks`: the blocks around experts (routers, shared experts) and the
  forwards epmoe puts in place of theirs, which call the engine's routed path.
* :mod:`~epmoe.integrations.input_weighted`: blocks whose experts take every token, scaled by the
  router (Llama4's), and their forward.
* :mod:`~epmoe.integrations.zero_experts`: experts beside zero-computation experts (LongCat-Flash's in transformers 5.24, custom models),
  whose ids return the token times its weight, and their forward.
* :mod:`~epmoe.integrations.peft`: PEFT LoRA factors on expert-parallel experts and their layouts.
* :mod:`~epmoe.integrations.transformers_experts`: ``experts_implementation="epmoe"``, epmoe's routed
  MLP registered in transformers' ``ExpertsInterface`` (one device, no other code).

The model zoo the demo, benchmarks and tests build from configs is :mod:`epmoe.models`.
"""
