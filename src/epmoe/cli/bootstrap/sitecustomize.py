"""``epmoe run``'s bootstrap: the only file of the directory ``epmoe run`` puts first on ``PYTHONPATH``.

Python imports it at start-up in every process the command starts. It runs the ``sitecustomize`` the
environment would have loaded without it, then, where ``EPMOE_RUN`` is set, hooks the execution of
``transformers.modeling_utils`` and ``transformers.trainer`` (and axolotl's ``axolotl.train``: a ``sys.meta_path``
finder, nothing imported early): what the hooks do lives in :mod:`epmoe.compose.run`, imported only once transformers is."""

import importlib.machinery
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HOOKED = ("transformers.modeling_utils", "transformers.trainer", "axolotl.train")


def _chain() -> None:
    """Execute the ``sitecustomize`` found on ``sys.path`` past this directory, as site would have."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _after(name: str, module) -> None:
    try:
        from epmoe.compose import run
    except ImportError as error:
        raise ImportError(f"epmoe run: {sys.executable} cannot import epmoe ({error}); install epmoe there") from error
    run.hook(name, module)


class _Finder:
    """Finds the hooked modules with the finders after it and runs :func:`_after` once each has executed."""

    def find_spec(self, name, path=None, target=None):
        if name not in HOOKED:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and hasattr(spec.loader, "exec_module"):
                execute = spec.loader.exec_module

                def exec_module(module, execute=execute):
                    execute(module)
                    _after(name, module)

                spec.loader.exec_module = exec_module
                return spec
        return None


_chain()
if os.environ.get("EPMOE_RUN"):
    sys.meta_path.insert(0, _Finder())
    for _name in HOOKED:  # executed already (by the environment's own sitecustomize): hooked now
        if _name in sys.modules:
            _after(_name, sys.modules[_name])
