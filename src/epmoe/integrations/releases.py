"""The transformers releases epmoe runs a transformers model under: the ones its suite tests.

epmoe reads transformers' experts modules by structure, and saves, loads and prepares transformers
models through transformers' own hooks (``gather_sharded_state_dict_for_save``, the weight
conversions, the Trainer's methods). A release whose hooks differ can leave a model silently wrong or
a checkpoint incomplete (at transformers 5.6 ``save_pretrained`` has no hook to gather experts
through, and would write one rank's experts under the unsharded names). So a transformers model is
made expert-parallel only under a release the suite runs (:data:`TESTED`, the pinned test
environment's, ``constraints/test.txt``); any other release is refused when EP is applied, naming the
range, before anything changes. Models that are not transformers models are not concerned.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

TESTED = SpecifierSet(">=5.6,<5.26")  # constraints/test.txt pins 5.25.0: widen only with a test environment


def untested_release(model: nn.Module | None = None) -> str | None:
    """Why epmoe does not run ``model`` (``None``: any transformers model) under the transformers this
    process imported, ``None`` where it does: ``model`` is no transformers model, or the release is one
    of :data:`TESTED`."""
    transformers = sys.modules.get("transformers")
    if transformers is None or (model is not None and not isinstance(model, transformers.PreTrainedModel)):
        return None
    return untested_transformers(installed_transformers())


def installed_transformers() -> str:
    """The release of the transformers this process runs (as its distribution says)."""
    return importlib.metadata.version("transformers")


def untested_transformers(version: str) -> str | None:
    """Why epmoe runs no transformers model under transformers ``version``, ``None`` where it is one
    of :data:`TESTED`."""
    release = Version(version)
    if release in TESTED:
        return None
    return (
        f"transformers {release} is not a release epmoe is tested with (transformers{TESTED}): its save, load and "
        f"Trainer hooks may differ, leaving the model or its checkpoints incomplete; install a tested release "
        f"(pip install 'transformers{TESTED}')"
    )


# The model directories whose experts an older tested release lays out in a way epmoe refuses, by the
# tested release from which epmoe runs them exactly (tests/models/test_families.py, per release)
SERVED_FROM = {"aria": "5.25", "granitemoe": "5.25", "granitemoehybrid": "5.25"}


def served_from(module: nn.Module) -> str | None:
    """Where the transformers this process runs lays out ``module``'s family (a transformers experts
    module) in a way epmoe refuses and a later tested release does not (:data:`SERVED_FROM`): the
    sentence naming that release, for the refusal; ``None`` elsewhere."""
    path = type(module).__module__.split(".")
    release = SERVED_FROM.get(path[2]) if path[:2] == ["transformers", "models"] and len(path) > 2 else None
    if release is None or Version(installed_transformers()) >= Version(release):
        return None
    return f"epmoe runs {path[2]}'s experts as transformers {release} lays them out ('transformers>={release}')"
