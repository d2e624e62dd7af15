"""A stand-in for torchaudio, for tests/training/test_llamafactory.py only (test setup, never the library).

LLaMA-Factory 0.9.5 imports torchaudio at the top of ``llamafactory/data/mm_plugin.py`` and calls it only
to load audio inputs. PyPI's torchaudio wheels need another torch than this machine's CPU torch 2.13.0,
so ``.venv-llamafactory`` has none, and the test puts this directory on the launches' ``PYTHONPATH``: the
import succeeds, and anything used of it raises, naming it (the text-only runs use nothing).
"""


def __getattr__(name: str):
    raise ModuleNotFoundError(
        f"torchaudio.{name}: this is the test stand-in (tests/support/torchaudio_standin), not torchaudio"
    )
