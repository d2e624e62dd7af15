"""Checkpoints of EP models: ``save_pretrained`` writes every expert (:mod:`epmoe.checkpoint.save`)."""
