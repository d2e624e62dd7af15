"""The transformers releases epmoe runs a transformers model under: the range its suite tests.

epmoe reads transformers' experts modules by structure, and saves, loads and prepares transformers
models through transformers' own machinery (``save_pretrained``, the weight conversions, the
Trainer's methods), adapting to what each release has (a hook, a method, a decorator option) rather
than to its number. A release outside the range the suite runs could differ in a way epmoe has not
seen and leave a model silently wrong or a checkpoint incomplete. So a transformers model is made
expert-parallel only under a release of :data:`TESTED`, whose ends the suite's two environments run
(``constraints/oldest.txt``: 5.6.0, the oldest a popular fine-tuning framework pins;
``constraints/test.txt``: the newest); any other release is refused when EP is applied, naming the
range, before anything changes. Models that are not transformers models are not concerned.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

TESTED = SpecifierSet(">=5.6,<5.26")  # constraints/oldest.txt 5.6.0, test.txt 5.25.0: move with them


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def untested_release(model: nn.Module | None = None) -> str | None:
    """Why epmoe does not run ``model`` (``None``: any transformers model) under the transformers this
    process imported, ``None`` where it does: ``model`` is no transformers model, or the release is one
    of :data:`TESTED`."""
    if "transformers" not in sys.modules or (model is not None and not is_transformers_model(model)):
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
